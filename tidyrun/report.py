"""ShutdownReport: what a shutdown released and what survived it, grouped by the object that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .audit import Survivor, unique_storage_bytes


@dataclass
class ShutdownReport:
    """What a shutdown released and what, if anything, survived it."""

    released_bytes: dict[str, int] = field(default_factory=dict)  # by owner, live before release
    survivors: list[Survivor] = field(default_factory=list)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # release steps that failed (the others went on)

    @property
    def clean(self) -> bool:
        return not self.survivors and not self.errors

    @property
    def leaked_bytes(self) -> int:
        """Bytes the survivors keep alive, each shared storage counted once."""
        return unique_storage_bytes(self.survivors)

    def by_holder(self) -> dict[str, list[Survivor]]:
        """Survivors grouped by the root that holds them, the group keeping the most memory first."""
        groups: dict[str, list[Survivor]] = {}
        for s in self.survivors:
            groups.setdefault(s.held_by, []).append(s)
        return dict(sorted(groups.items(), key=lambda kv: -unique_storage_bytes(kv[1])))

    def __str__(self) -> str:
        """One line per holder with one example chain; ``details()`` has every chain."""
        total = sum(self.released_bytes.values())
        head = f"released {total / 2**20:.1f} MiB ({', '.join(f'{k}={v / 2**20:.1f} MiB' for k, v in self.released_bytes.items())}) in {self.seconds * 1e3:.0f} ms"
        if self.clean:
            return head + "; nothing survived"
        lines = [head] + [f"  error: {e}" for e in self.errors]
        if not self.survivors:
            return "\n".join(lines)
        lines.append(f"{_count(self.survivors)} survived shutdown, holding {_size(self.leaked_bytes)}:")
        for holder, group in self.by_holder().items():
            example = max(group, key=lambda s: s.nbytes)  # the biggest, the first of equals
            lines.append(f"  {_count(group)}, {_size(unique_storage_bytes(group))}, held by {holder}")
            lines.append(f"    e.g. {example.description}: {example.chain}")
        if any(s.partial for s in self.survivors):
            lines.append("  (a search bound cut some chains short: their holder is unknown)")
        return "\n".join(lines)

    def details(self) -> str:
        """Every survivor on its own line: its own bytes, the storage it keeps alive if larger, its full chain."""
        return "\n".join(f"{s.description} ({_bytes(s)}) held by {s.chain}" for s in self.survivors)


def _bytes(s: Survivor) -> str:
    own = _size(s.nbytes)
    return own if s.storage_nbytes == s.nbytes else f"{own} of a {_size(s.storage_nbytes)} storage"


def _count(survivors: list[Survivor]) -> str:
    noun = "tensor" if all(s.description.startswith("tensor(") for s in survivors) else "object"
    return f"{len(survivors)} {noun}{'' if len(survivors) == 1 else 's'}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
