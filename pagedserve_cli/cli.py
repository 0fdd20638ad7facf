"""The ``pagedserve`` command: ``up`` starts the local stack; ``generate`` and ``chat`` talk to a gateway.

``generate`` and ``chat`` are plain gRPC clients of ``pagedserve.gateway.v1.Gateway``: they need no
model files and never import the compute service. ``python -m pagedserve.cli`` runs this module too
(pagedserve/cli.py hands over to it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc


from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.log import LOG_FORMATS
from pagedserve.service_auth import API_KEY_ENV

DEFAULT_ADDRESS = "127.0.0.1:50051"


class NotListening(Exception):
    """Nothing answers at the gateway address."""


def api_key(args: argparse.Namespace) -> str | None:
    """The key to send: ``--api-key-file``'s, else ``--api-key``'s (with a warning), else ``$PAGEDSERVE_API_KEY``.

    Why the warning: a key on the command line is readable by every user of the machine (``ps``,
    ``/proc/PID/cmdline``) and kept in the shell's history; a file or the environment is not.

    Raises:
        ValueError: both flags given, or the file unreadable or empty.
    """
    if args.api_key_file is not None:
        if args.api_key is not None:
            raise ValueError("give --api-key-file or --api-key, not both")
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file {args.api_key_file!r}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file!r} is empty")
        return key
    if args.api_key is not None:
        print(f"warning: --api-key puts the key on the command line, where other users of this machine can read it "
              f"(ps) and the shell history keeps it; use --api-key-file FILE or ${API_KEY_ENV}", file=sys.stderr)
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def _stub(args: argparse.Namespace) -> tuple[gateway_pb2_grpc.GatewayStub, list[tuple[str, str]]]:
    key = api_key(args)  # before connecting: a bad flag is an error even with no gateway up
    channel = grpc.insecure_channel(args.address)
    try:
        grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
    except grpc.FutureTimeoutError:
        raise NotListening(args.address) from None
    metadata = [("authorization", f"Bearer {key}")] if key else []
    return gateway_pb2_grpc.GatewayStub(channel), metadata


def _request(args: argparse.Namespace, messages: list[gateway_pb2.ChatMessage] | None) -> gateway_pb2.GenerateRequest:
    params = gateway_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        params.seed = args.seed
    if messages is None:
        return gateway_pb2.GenerateRequest(prompt=args.prompt, params=params)
    return gateway_pb2.GenerateRequest(messages=messages, params=params)


def _stream(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
            metadata: list[tuple[str, str]], timeout: float | None) -> Iterator[gateway_pb2.GenerateStreamResponse]:
    """Prints each piece as it arrives; yields every message."""
    for piece in stub.GenerateStream(request, metadata=metadata, timeout=timeout):
        print(piece.text, end="", flush=True)
        yield piece


def cmd_generate(args: argparse.Namespace) -> int:
    """One prompt (through the chat template unless --raw), streamed to the terminal by default."""
    stub, metadata = _stub(args)
    messages = None if args.raw else [gateway_pb2.ChatMessage(role="user", content=args.prompt)]
    request = _request(args, messages)
    if args.no_stream:
        reply = stub.Generate(request, metadata=metadata, timeout=args.timeout)
        print(reply.choices[0].text)
        usage, finish_reason = reply.usage, reply.choices[0].finish_reason
    else:
        pieces = list(_stream(stub, request, metadata, args.timeout))
        print()
        usage, finish_reason = pieces[-1].usage, pieces[-1].finish_reason
    print(f"[{usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} from the prefix cache), "
          f"{usage.completion_tokens} generated, finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """An interactive chat: each line you type is a user turn; the history is kept (Ctrl-D ends)."""
    stub, metadata = _stub(args)
    history: list[gateway_pb2.ChatMessage] = []
    if args.system:
        history.append(gateway_pb2.ChatMessage(role="system", content=args.system))
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        history.append(gateway_pb2.ChatMessage(role="user", content=line))
        print("assistant> ", end="", flush=True)
        text = "".join(p.text for p in _stream(stub, _request(args, history), metadata, args.timeout))
        print()
        history.append(gateway_pb2.ChatMessage(role="assistant", content=text))


def cmd_up(args: argparse.Namespace) -> int:
    from pagedserve_cli.up import PASS_THROUGH, UpConfig, run_up

    return run_up(UpConfig(model=args.model, host=args.host, port=args.port, http_port=args.http_port,
                           service_flags={item.field: getattr(args, item.field) for item in PASS_THROUGH},
                           config_file=args.config, log_format=args.log_format,
                           drain_timeout_s=args.drain_timeout_s))


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help=f"gateway address (default {DEFAULT_ADDRESS})")
    parser.add_argument("--api-key-file", help=f"a file holding the API key (else ${API_KEY_ENV})")
    parser.add_argument("--api-key", help="the API key itself (discouraged: visible to other users in ps; "
                                          "use --api-key-file or the environment)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help=argparse.SUPPRESS)


def build_parser(with_up_flags: bool = True) -> argparse.ArgumentParser:
    """The command line. ``with_up_flags``: derive ``up``'s pass-through flags from the services'
    configs, which imports them (torch included): ``main`` does so only for ``up``."""
    parser = argparse.ArgumentParser(prog="pagedserve", description="PagedAttention LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start memory, compute and gateway locally (Ctrl-C stops them)")
    up.add_argument("--model", default="default",
                    help="'default' (SmolLM2-135M-Instruct), a local Hugging Face model directory or a GGUF file")
    up.add_argument("--port", type=int, default=50051, help="gateway gRPC port (default 50051)")
    up.add_argument("--http-port", type=int, default=8000,
                    help="port of the OpenAI-compatible HTTP API (default 8000; 0 = any free port)")
    up.add_argument("--host", default="127.0.0.1", help="bind host of both gateway fronts (default 127.0.0.1)")
    up.add_argument("--log-format", choices=LOG_FORMATS,
                    help="the services' log lines: json or console (default: console on a terminal, json otherwise)")
    up.add_argument("--config", help="JSON config file for the memory and compute services")
    up.add_argument("--drain-timeout-s", type=float, default=30.0,
                    help="on Ctrl-C or SIGTERM, seconds each service may drain: requests in flight finish "
                         "(gateway, then compute, then memory; default 30)")
    if with_up_flags:  # the services' own flags that up passes on (pagedserve_cli/up.py's PASS_THROUGH)
        from pagedserve_cli.up import add_pass_through_flags

        add_pass_through_flags(up)
    up.set_defaults(func=cmd_up)
    gen = sub.add_parser("generate", help="send one prompt to the gateway and stream the answer")
    gen.add_argument("prompt")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--no-stream", action="store_true", help="wait for the whole answer (unary Generate)")
    _client_flags(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="chat with the model through the gateway (Ctrl-D ends)")
    chat.add_argument("--system", help="system message")
    _client_flags(chat)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_up_flags=argv[:1] == ["up"]).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NotListening as exc:
        print(f"error: no gateway is listening at {exc}; start one with `pagedserve up` (or pass --address)",
              file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
