"""``from tidyrun.utils import FlexibleArgumentParser``: where vLLM's offline examples import their parser from."""

from .arg_utils import FlexibleArgumentParser

__all__ = ("FlexibleArgumentParser",)
