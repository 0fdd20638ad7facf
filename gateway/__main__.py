"""python -m gateway: serve the public API in front of one or more compute services."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pagedserve.config import add_config_file_flag, config_from_args
from pagedserve.log import add_log_format_flag, configure_logging
from pagedserve.process import add_parent_pid_flag, die_with_parent

from gateway.config import API_KEYS_ENV, GatewayConfig
from pagedserve.service_auth import TOKEN_ENV


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="pagedserve gateway: the public gRPC API (pagedserve.gateway.v1.Gateway), and with --http-port "
                    "the OpenAI-compatible HTTP API, in front of compute services.",
    )
    add_config_file_flag(p)
    p.add_argument("--backend", dest="backends", action="append",
                   help="compute service: host:port, unix:PATH, or dns:NAME:PORT (every address NAME resolves to); repeat for more")
    p.add_argument("--listen", help="public address host:port (default 127.0.0.1:50051)")
    p.add_argument("--http-port", dest="http_port", type=int,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health) on this port; none without the flag")
    p.add_argument("--http-host", dest="http_host", help="bind address of the HTTP API (default: the --listen host)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="serve Prometheus metrics over HTTP on this port")
    p.add_argument("--metrics-host", dest="metrics_host", help="bind address of the metrics server (default 127.0.0.1)")
    p.add_argument("--api-keys-file", dest="api_keys_file",
                   help="tenants and their keys, sent as 'authorization: Bearer KEY': a JSON file "
                        '{"tenants": {"NAME": {"keys": [...], "max_priority": 0, "max_concurrent": N}}} or one key '
                        f"per line (tenants key-1, key-2, ...); also ${API_KEYS_ENV} (comma-separated)")
    p.add_argument("--write-stall-timeout-s", dest="write_stall_timeout_s", type=float,
                   help="end a stream whose client reads nothing for this long, aborting its backend request "
                        "(default 30)")
    p.add_argument("--tokenize-threads", dest="tokenize_threads", type=int,
                   help="threads that tokenize prompts (default 2)")
    p.add_argument("--tls-cert", dest="tls_cert_file", help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", dest="tls_key_file", help="PEM private key of --tls-cert")
    p.add_argument("--backend-token-file", dest="backend_token_file",
                   help=f"send this file's token to every backend (its --auth-token-file); also ${TOKEN_ENV}")
    p.add_argument("--max-queued-requests", dest="max_queued_requests", type=int,
                   help="requests held at once; more are answered RESOURCE_EXHAUSTED (default 1024)")
    p.add_argument("--health-interval-s", dest="health_interval_s", type=float, help="backend health/load poll interval (default 1)")
    p.add_argument("--dns-refresh-s", dest="dns_refresh_s", type=float, help="re-resolve dns: backends this often (default 10)")
    p.add_argument("--grace-period-s", dest="grace_period_s", type=float, help="after SIGTERM, time for in-flight streams (default 30)")
    p.add_argument("--drain-delay-s", dest="drain_delay_s", type=float,
                   help="after SIGTERM, keep taking requests this long while NOT_SERVING (default 0)")
    p.add_argument("--log-prompts", dest="log_prompts", action="store_const", const=True, help="put prompt text in access logs")
    p.add_argument("--log-level", dest="log_level", default="info", help="debug, info, warning, error")
    add_log_format_flag(p)
    add_parent_pid_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)  # first: see pagedserve.process
    try:
        configure_logging(args.log_level, log_format=args.log_format)
        if args.backends is not None:
            args.backends = tuple(args.backends)
        config = config_from_args(GatewayConfig, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from gateway.server import serve

    try:
        asyncio.run(serve(config))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
