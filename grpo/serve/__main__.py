"""``python -m grpo.serve`` / ``grpo serve``: the Tinker HTTP API on this machine.

    python -m grpo.serve                      # 127.0.0.1:8000, prints a fresh tml- key
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=<key> python your_tinker_script.py
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys

from grpo.models import precision
from grpo.serve import limits

KEY_VAR = "GRPO_SERVE_API_KEY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo.serve",
                                     description="Serve grpo's local backend over the Tinker HTTP API.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help=f"key clients must send (must start with tml-); default ${KEY_VAR}, else a fresh one")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="the checkpoint store tinker:// paths live in (default $GRPO_CACHE/checkpoints)")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    # The backend config's two keys, checked and resolved by the same code (grpo/models/precision.py)
    parser.add_argument("--train-dtype", default=None,
                        help="precision of the base weights in training: fp32, bf16 or auto (default auto: "
                             "bf16 on CUDA; on a CPU whichever this machine measured faster for the model)")
    parser.add_argument("--sample-dtype", default=None,
                        help="the same for sampling, decided separately (default auto)")
    parser.add_argument("--dtype", default=None,
                        help="both at once where --train-dtype/--sample-dtype are not given (older flag)")
    parser.add_argument("--long-poll", type=float, default=30.0,
                        help="seconds a result poll is held open before the client is told to try again")
    parser.add_argument("--fwdbwd-chunk-len", type=int, default=None,
                        help="datums per forward_backward request the SDK sends (default: the SDK's, 1024)")
    parser.add_argument("--prefix-cache-mb", default="auto", type=_prefix_cache_mb,
                        help="the sampler's prefix cache, which lets a client sampling turn after turn on a "
                             "growing context prefill only the new tokens (auto: the memory budget; 0: off)")
    limits.add_arguments(parser)
    args = parser.parse_args(argv)
    for flag in ("--train-dtype", "--sample-dtype", "--dtype"):
        try:
            precision.check(flag, getattr(args, flag[2:].replace("-", "_")))
        except ValueError as err:
            parser.error(str(err))
    return args


def _prefix_cache_mb(text: str) -> str | float:
    """--prefix-cache-mb by the backend's own rule for ``prefix_cache_mb`` (the default "auto" is
    taken as it is, so a plain start does not import the backend before the flags are read)."""
    if text == "auto":
        return text
    from grpo.backends.local import memory

    value = memory.megabytes_from_text(text)
    try:
        memory.resolve_prefix_cache(value, None)  # checks only
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def resolve_api_key(explicit: str | None) -> tuple[str, bool]:
    """(key, generated). A key from the flag or environment must start with tml-."""
    key = explicit or os.environ.get(KEY_VAR, "")
    if not key:
        return "tml-" + secrets.token_urlsafe(24), True
    if not key.startswith("tml-"):
        raise SystemExit(f"grpo serve: the API key (--api-key or ${KEY_VAR}) must start with 'tml-', "
                         "as the Tinker SDK refuses any other")
    return key, False


def exposure_warning(host: str) -> str | None:
    """The warning printed when the server is reachable from other machines."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"grpo serve: WARNING: binding {host} exposes training on this machine to the network; "
            "anyone who has the API key can use it. Plain HTTP: use a tunnel or proxy for TLS.")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    limits.from_args(args)  # a bad limit fails before any model loads
    key, generated = resolve_api_key(args.api_key)
    warning = exposure_warning(args.host)
    if warning:
        print(warning, file=sys.stderr)
    import uvicorn

    from grpo.backends.local.clients import ServiceClient
    from grpo.serve.app import create_app

    service = ServiceClient(checkpoint_dir=args.checkpoint_dir, device=args.device, dtype=args.dtype,
                            train_dtype=args.train_dtype, sample_dtype=args.sample_dtype,
                            prefix_cache_mb=args.prefix_cache_mb)
    app = create_app(key, service, long_poll_s=args.long_poll, fwdbwd_chunk_len=args.fwdbwd_chunk_len,
                     limits=limits.from_args(args))
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    print(f"grpo serve: Tinker API at {url}", flush=True)
    print(f"  export TINKER_BASE_URL={url}", flush=True)
    if generated:
        print(f"  export TINKER_API_KEY={key}   (generated; set ${KEY_VAR} to choose one)", flush=True)
    else:
        print(f"  export TINKER_API_KEY=<the key from --api-key or ${KEY_VAR}>", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
