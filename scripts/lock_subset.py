"""Print the part of requirements/lock.txt that pagedserve needs at run time, pins and hashes as they are.

The lock covers pagedserve[test] (and the build backend); the image installs only what the service
runs: the closure of pyproject.toml's `dependencies` through the lock's `# via` notes (a package is
kept when a kept package, or pyproject's run-time list, requires it). pip cannot take hashes from a
constraints file, so the image installs this subset as a hashed requirements file, with --no-deps.

Usage: python scripts/lock_subset.py [--without NAME ...] [--lock PATH] [--pyproject PATH]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9._-]+)==")
PROJECT = "pagedserve (pyproject.toml)"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0])


def entries(lock_text: str) -> dict[str, tuple[str, set[str]]]:
    """Package -> (its block of the lock: the pin, hashes and notes; the packages it is required via)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for block in re.split(r"^(?=[A-Za-z0-9._-]+==)", lock_text, flags=re.M):
        pin = PIN.match(block)
        if not pin:
            continue
        notes = [line.strip().lstrip("#").strip() for line in block.splitlines() if line.strip().startswith("#")]
        via = set()
        for note in notes:
            note = note.removeprefix("via").strip()
            if note.startswith("-c ") or not note:
                continue
            via.add(PROJECT if note == PROJECT else canonical(note.split()[0]))
        pinned = "\n".join(line for line in block.splitlines() if not line.strip().startswith("#")).rstrip()
        found[canonical(pin.group(1))] = (pinned, via)
    return found


def runtime_subset(lock_text: str, dependencies: list[str], without: set[str]) -> list[str]:
    """The lock's blocks for the closure of `dependencies`, less the packages `without` themselves
    (installed otherwise, like the image's torch, or left out, like Triton on a CPU: what they require
    stays, so that a torch installed with --no-deps finds its own dependencies)."""
    locked = entries(lock_text)
    keep = {requirement_name(d) for d in dependencies}
    missing = keep - set(locked)
    if missing:
        raise SystemExit(f"lock_subset: the lock lacks the dependencies {sorted(missing)}: run scripts/lock.sh")
    changed = True
    while changed:
        changed = False
        for name, (_, via) in locked.items():
            if name not in keep and via & keep:
                keep.add(name)
                changed = True
    return [locked[name][0] for name in sorted(keep - without)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", action="append", default=[], help="leave out this package (repeatable)")
    parser.add_argument("--lock", type=Path, default=ROOT / "requirements" / "lock.txt")
    parser.add_argument("--pyproject", type=Path, default=ROOT / "pyproject.toml")
    args = parser.parse_args()
    dependencies = tomllib.loads(args.pyproject.read_text())["project"]["dependencies"]
    blocks = runtime_subset(args.lock.read_text(), dependencies, {canonical(n) for n in args.without})
    sys.stdout.write("\n".join(blocks) + "\n")


if __name__ == "__main__":
    main()
