"""Command line: ``tidyrun generate``, ``chat``, ``serve`` and ``audit``."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
import sys

from .errors import TidyrunError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the accelerator if present)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks to split the model over (default 1)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences batched in one step at most (default 256)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(args):
    from .sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop)


def _build(args):
    from .engine import LLM

    return LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
               tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=args.max_num_seqs)


def cmd_generate(args) -> int:
    params = _params(args)
    with _build(args) as llm:
        use_template = llm.tokenizer.has_chat_template and not args.raw
        prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])}
                   if use_template else p for p in args.prompts]
        if len(prompts) == 1:
            for piece in llm.stream(prompts[0], params):
                print(piece, end="", flush=True)
            print()
        else:
            for prompt, out in zip(args.prompts, llm.generate(prompts, params, use_tqdm=True)):
                print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    with _build(args) as llm:
        messages: list[dict] = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        print("tidyrun chat: empty line or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            ids = llm.tokenizer.apply_chat_template(messages)
            reply = []
            for piece in llm.stream({"prompt_token_ids": ids}, params):
                print(piece, end="", flush=True)
                reply.append(piece)
            print()
            messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _audit_tidyrun(args, device) -> Iterator[tuple[str, object]]:
    from .audit import leaks_since, snapshot
    from .engine import LLM
    from .sampling_params import SamplingParams

    snap = snapshot()
    with LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
             tensor_parallel_size=args.tensor_parallel_size) as llm:
        yield "created", llm.ledger_report()
        llm.generate([args.prompt] * 4, SamplingParams(max_tokens=args.max_tokens), use_tqdm=False)
        yield "generated", None
    yield "shutdown", str(llm.shutdown())
    yield "survivors", leaks_since(snap, device=None if device.type == "cpu" else device.type)


def _audit_transformers(args, device) -> Iterator[tuple[str, object]]:
    """The usual recipe users apply to a transformers model: del, gc.collect, empty_cache."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .audit import find_device_tensors, leaks_since, snapshot, unique_storage_bytes
    from .loader import default_model_path

    path = args.model or default_model_path()
    kwargs = {}
    if path.endswith(".gguf"):
        import os

        path, kwargs["gguf_file"] = os.path.split(path)
    snap = snapshot()
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                                                 **kwargs).to(device)
    found = find_device_tensors(model, device.type)
    yield "created", f"{len(found)} tensors, {unique_storage_bytes(found) / 2**20:.1f} MiB reachable from the model"
    ids = tok([args.prompt] * 4, return_tensors="pt").to(device)
    with torch.no_grad():
        model.generate(**ids, max_new_tokens=args.max_tokens, do_sample=False)
    yield "generated", None
    del model, ids
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    yield "shutdown", "del model; gc.collect(); torch.cuda.empty_cache()"
    yield "survivors", leaks_since(snap, device=None if device.type == "cpu" else device.type)


def cmd_audit(args) -> int:
    """create -> generate -> shutdown N times, printing memory at each step and any survivors."""
    from .memory import sample_memory
    from .runner.device import resolve_device

    device = resolve_device(args.device)
    if device.type == "cuda":
        import torch

        torch.cuda.init()
        torch.empty(1, device=device)  # the CUDA context is not ours to give back
        del torch
    base = sample_memory(device)
    print(f"baseline            {base}")
    audit = _audit_tidyrun if args.engine == "tidyrun" else _audit_transformers
    leaked_any = False
    for cycle in range(1, args.cycles + 1):
        for step, detail in audit(args, device):
            if step == "survivors":
                leaked_any |= bool(detail)
                for s in detail[:20]:
                    print(f"  survivor: {s.description} ({s.nbytes} B) held by {s.chain}")
                if len(detail) > 20:
                    print(f"  ... {len(detail) - 20} more survivors")
                continue
            mem = sample_memory(device)
            print(f"cycle {cycle} {step:<10} {mem}   (delta vs baseline: {mem.delta(base)})")
            if detail and args.verbose:
                print("  " + str(detail).replace("\n", "\n  "))
    final = sample_memory(device).delta(base)
    print(f"after {args.cycles} cycle(s): {final} above baseline; {'survivors found' if leaked_any else 'no survivors'}")
    return 1 if leaked_any else 0


# Seconds uvicorn waits, after the grace period, for the aborted requests' last chunks to be written before it
# cancels their handlers (which would cut the streams and log CancelledError tracebacks).
_ABORT_FLUSH_S = 5.0


def _graceful_server(config, grace_s: float, abort_all):
    """A uvicorn server whose SIGTERM/SIGINT stop is the README's: stop accepting, let requests in flight run
    ``grace_s`` seconds, then ``abort_all()`` so every remaining one ends with finish_reason "abort" (a
    stream's last chunk and [DONE], a 200 body) before uvicorn's own deadline; ``config`` carries that
    deadline (``grace_s + _ABORT_FLUSH_S``)."""
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done, so the process dies
        with the signal's status; by then the engine has shut down cleanly, so tidyrun exits 0."""

        def _start_grace(self) -> None:
            if not self.should_exit:  # the first stop request starts the grace period
                timer = threading.Timer(grace_s, abort_all)
                timer.daemon = True
                timer.start()

        def begin_stop(self) -> None:
            """Stop accepting and start the grace period (POST /shutdown, or the engine died)."""
            self._start_grace()
            self.should_exit = True

        def handle_exit(self, sig, frame) -> None:
            self._start_grace()  # before uvicorn's handler: a second Ctrl-C still forces the exit
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

    return GracefulServer(config)


def cmd_serve(args) -> int:
    """OpenAI-compatible server; SIGTERM/SIGINT stop it gracefully and shut the engine down."""
    import logging
    import os

    import uvicorn

    from .server import EngineLoop, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = _build(args)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else "SmolLM2-135M-Instruct")
    server: uvicorn.Server | None = None

    def request_exit() -> None:
        server.begin_stop()  # POST /shutdown, or the engine died: the same grace period as a signal

    loop = EngineLoop(llm, on_death=lambda reason: request_exit())  # a dead engine stops the server: exit 1

    app = create_app(loop, name, api_key=args.api_key,
                     request_exit=request_exit if args.enable_shutdown_endpoint else None,
                     enable_lifecycle_endpoints=args.enable_lifecycle_endpoints, admin_key=args.admin_key,
                     weights_dir=args.weights_dir, trust_request_chat_template=args.trust_request_chat_template)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.graceful_timeout + _ABORT_FLUSH_S)
    server = _graceful_server(config, args.graceful_timeout, loop.abort_all)
    try:
        server.run()
    finally:
        if not llm.is_shut_down:  # lifespan did not stop the loop (e.g. the port was taken): stop it, in order
            loop.stop()
    report = loop.shutdown_report
    if loop.died is not None:
        print(f"tidyrun serve: the engine died ({loop.died}); engine shut down: {report}", file=sys.stderr)
        return 1
    print(f"tidyrun serve: engine shut down: {report}", file=sys.stderr)
    return 0 if report is not None and report.clean else 1


def _check_serve_args(parser: argparse.ArgumentParser, args) -> None:
    """Refuse an unsafe or ineffective admin setup as a usage error (exit 2), before the model is loaded."""
    from .server.app import admin_key_of

    try:
        admin_key_of(args.enable_lifecycle_endpoints, args.api_key, args.admin_key, args.weights_dir,
                     args.enable_shutdown_endpoint)
    except ValueError as exc:
        parser.error(str(exc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidyrun", description="In-process LLM inference that cleans up after itself")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one or more prompts (streams a single prompt)")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--raw", action="store_true", help="do not wrap prompts in the model's chat template")
    _engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat, streaming replies")
    chat.add_argument("--system", default=None, help="system prompt")
    _engine_args(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on the /v1 routes (and on the lifecycle routes "
                            "when no --admin-key is given)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let chat requests bring their own chat_template (a Jinja template the server renders; "
                            "refused without this switch, as in vLLM)")
    serve.add_argument("--graceful-timeout", type=float, default=10.0,
                       help="seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted")
    admin = serve.add_argument_group(
        "lifecycle and admin routes",
        "POST /sleep, /wake_up, /reset_prefix_cache, /update_weights, /shutdown and GET /is_sleeping change or stop "
        "what every client is served; they do not exist (404) unless enabled here, and then each needs "
        "'Authorization: Bearer <admin key>'")
    admin.add_argument("--enable-lifecycle-endpoints", action="store_true",
                       help="expose the lifecycle routes (vLLM keeps them behind its dev mode); needs --admin-key "
                            "or --api-key")
    admin.add_argument("--admin-key", default=None, metavar="KEY",
                       help="the key of the lifecycle routes (default: --api-key); /v1 clients never need it")
    admin.add_argument("--weights-dir", default=None, metavar="DIR",
                       help="expose POST /update_weights, reading only files that resolve (after '..' and symbolic "
                            "links) inside DIR; relative request paths are taken from DIR")
    admin.add_argument("--enable-shutdown-endpoint", action="store_true",
                       help="also expose POST /shutdown; needs --enable-lifecycle-endpoints (stopping the server "
                            "stays a separate opt-in)")
    _engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    audit = sub.add_parser("audit", help="create -> generate -> shutdown N times; print memory and survivors")
    audit.add_argument("--engine", choices=["tidyrun", "transformers"], default="tidyrun")
    audit.add_argument("--cycles", type=int, default=3)
    audit.add_argument("--prompt", default="The capital of France is")
    audit.add_argument("--max-tokens", type=int, default=16)
    audit.add_argument("--verbose", "-v", action="store_true", help="print the ledger and shutdown reports")
    _engine_args(audit)
    audit.set_defaults(func=cmd_audit)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (2: a tidyrun error, 130: Ctrl-C).

    Ctrl-C ends the command at once with one line and no traceback; the
    engine was shut down on the way out.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        _check_serve_args(parser, args)
    try:
        return args.func(args)
    except TidyrunError as exc:
        print(f"tidyrun: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntidyrun: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
