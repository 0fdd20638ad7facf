"""python -m gateway: serve the public API in front of one or more compute services."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pagedserve.config import add_config_flags, add_service_flags, config_from_args
from pagedserve.log import configure_logging
from pagedserve.process import die_with_parent, exit_skipping_teardown, raise_open_files_limit

from gateway.config import API_KEYS_ENV, GatewayConfig
from pagedserve.service_auth import TOKEN_ENV


# The flags: GatewayConfig's fields (their defaults are the dataclass's).
FLAGS = {
    "backends": "compute service: host:port, unix:PATH, or dns:NAME:PORT (every address NAME resolves to); "
                "repeat for more",
    "listen": "public address host:port",
    "http_port": "also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                 "/health) on this port; none without the flag",
    "http_host": "bind address of the HTTP API (default: the --listen host)",
    "http_read_timeout_s": "an HTTP request's headers, then its body, must each arrive within this many seconds "
                           "(late headers: the connection is closed; a late body: 408)",
    "http_max_connections": "HTTP connections open at once (at most half the open-files limit); one more takes "
                            "the place of the one waiting longest for its headers, or is answered 503",
    "http_allowed_hosts": "a Host name the HTTP API answers ('*': any); repeat for more. localhost and IP "
                          "addresses always; without the flag, only those when there are no API keys and any with keys",
    "api_keys_file": "tenants and their keys, sent as 'authorization: Bearer KEY': a JSON file "
                     '{"tenants": {"NAME": {"keys": [...], "max_priority": 0, "max_concurrent": N}}} or one key '
                     f"per line (tenants key-1, key-2, ...); also ${API_KEYS_ENV} (comma-separated)",
    "max_prompts_per_request": "most prompts one HTTP /v1/completions request may list; more are a 400",
    "write_stall_timeout_s": "end a stream whose client reads nothing for this long, aborting its backend request",
    "tokenize_threads": "threads that tokenize prompts",
    "tls_cert_file": "PEM certificate chain: serve TLS (with --tls-key)",
    "tls_key_file": "PEM private key of --tls-cert",
    "backend_token_file": f"send this file's token to every backend (its --auth-token-file); also ${TOKEN_ENV}",
    "max_queued_requests": "requests held at once; more are answered RESOURCE_EXHAUSTED",
    "health_interval_s": "backend health/load poll interval",
    "dns_refresh_s": "re-resolve dns: backends this often",
    "grace_period_s": "after SIGTERM, time for in-flight streams",
    "drain_delay_s": "after SIGTERM, keep taking requests this long while NOT_SERVING",
    "log_prompts": "put prompt text in access logs",
    "tool_call_parser": "how tool_choice auto reads a model's tool calls: hermes (<tool_call> blocks), llama3_json "
                        "(Llama 3.x JSON), or auto (from the chat template)",
    "chat_template_file": "a Jinja chat template file to use instead of the backends' model's",
    "embedding_pooling": "how /v1/embeddings pools the final hidden states: last (the last prompt token's) or mean",
    "responses_store_max_responses": "per tenant, stored /v1/responses answers kept at most (oldest evicted first)",
    "responses_store_max_bytes": "per tenant, bytes of stored /v1/responses answers kept at most",
    "responses_store_ttl_s": "how long a stored /v1/responses answer is kept",
    "responses_store_max_total_bytes": "bytes of all tenants' stored /v1/responses answers kept at most (past it, "
                                       "the tenant holding the most loses its oldest)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway",
        description="pagedserve gateway: the public gRPC API (pagedserve.gateway.v1.Gateway), and with --http-port "
                    "the OpenAI-compatible HTTP API, in front of compute services.",
    )
    add_service_flags(p)
    add_config_flags(p, GatewayConfig, FLAGS, flag_names={"backends": "--backend", "tls_cert_file": "--tls-cert",
                                                          "tls_key_file": "--tls-key"})
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)  # first: see pagedserve.process
    raise_open_files_limit()  # see pagedserve.process: connections are descriptors
    try:
        config = config_from_args(GatewayConfig, args)
        configure_logging(config.log_level, log_format=args.log_format)
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
    status = main()
    if status == 0:  # a clean stop: no module teardown (see exit_skipping_teardown)
        exit_skipping_teardown(status)
    sys.exit(status)
