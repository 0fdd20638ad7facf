"""A structured-output constraint as the engine sees it: a kind and its text (no protobuf, no xgrammar)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from pagedserve.errors import InvalidArgument
from pagedserve.sampling_rules import check_constraint


@dataclass(frozen=True)
class Constraint:
    """What every completion of a request must follow.

    Attributes:
        kind: "json_schema", "json_object", "regex", "choice" or "grammar".
        spec: the JSON schema text, the regex or the EBNF grammar ("" for json_object and choice).
        choices: the alternatives of a choice constraint.

    Construction checks sizes only (``InvalidArgument`` naming the field); whether the text is valid is
    the grammar compiler's verdict.
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        check_constraint(self.kind, self.spec, self.choices, prefix="")
        if self.kind not in ("json_object", "choice") and self.choices:
            raise InvalidArgument(f"{self.kind}: choices are only for a choice constraint")
        if self.kind in ("json_object", "choice") and self.spec:
            raise InvalidArgument(f"{self.kind}: takes no spec text")

    @classmethod
    def json_schema(cls, schema: str | dict) -> Constraint:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> Constraint:
        return cls("choice", choices=tuple(choices))

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        return cls("grammar", ebnf)

    def digest(self) -> str:
        """sha256 of the kind and its text, length-prefixed so no two constraints collide."""
        h = hashlib.sha256()
        for part in (self.kind, self.spec, *self.choices):
            data = part.encode("utf-8", "surrogatepass")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

