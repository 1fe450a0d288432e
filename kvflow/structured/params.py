"""What a request's output must match: ``StructuredOutputsParams`` (part of SamplingParams).

Kept free of any grammar-engine import so SamplingParams stays cheap to build and to send over
ZMQ/msgspec (every field is a plain str / dict / list / bool).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvflow.utils.close_names import guess_unknown_keywords

# the constraint fields other than json_object (a flag), in the order ``kind`` reads them
_SPEC_FIELDS = ("json", "regex", "choice", "grammar", "structural_tag")


@guess_unknown_keywords
@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on the generated text (vLLM's ``StructuredOutputsParams``).

    Attributes:
        json: a JSON schema (dict or JSON text); the output is one JSON value valid for it.
        json_object: the output is any JSON object (OpenAI ``{"type": "json_object"}``).
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF / GBNF grammar whose ``root`` rule the output matches, or a Lark
            grammar (``start`` rule) in the subset ``lark_grammar`` converts.
        structural_tag: a structural tag (JSON text, as vLLM takes it, or a dict): free text
            until a trigger, then one of the structures it begins (begin string, a JSON
            value valid for its schema, end string), then free text again; the legacy
            ``{"structures": [...], "triggers": [...]}`` spelling or xgrammar's
            ``{"type": "structural_tag", "format": {...}}`` (``structural_tag.py``).

    Raises:
        ValueError: when none or more than one constraint is set, or a field has the wrong
            type (whether the schema / regex / grammar is well-formed is checked by the
            grammar backend, see ``kvflow.structured.validate``).
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in _SPEC_FIELDS if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise ValueError("SamplingParams.structured_outputs must set exactly one of json, "
                             "json_object, regex, choice, grammar, structural_tag (got "
                             f"{set_fields or 'none'})")
        if isinstance(self.choice, str):  # a string is no list: its letters would be the choices
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                "SamplingParams.structured_outputs.choice must be a non-empty list of "
                f"non-empty strings, got the string {self.choice!r:.40}: wrap it in a list")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("SamplingParams.structured_outputs.choice must be a non-empty list "
                             "of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"SamplingParams.structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("SamplingParams.structured_outputs.json must be a JSON schema "
                             "(a dict or JSON text)")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("SamplingParams.structured_outputs.structural_tag must be a "
                             "structural tag (a dict or JSON text)")

    @property
    def kind(self) -> str:
        """``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` or
        ``structural_tag``."""
        for name in _SPEC_FIELDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        self.__dict__.pop("_key", None)  # a field set anew: its key is computed anew
        self.__dict__.pop("_digest", None)

    @property
    def key(self) -> tuple[str, str]:
        """A hashable cache key and the text to compile: (kind, spec text).

        A schema dict becomes compact JSON text with its keys in the given order: the order
        of ``properties`` is the order the output's keys must follow (JSON Schema leaves it
        free; xgrammar and OpenAI keep it), so schemas differing only in order are different
        constraints and must not share a key.

        Computed once per object (the JSON text of a 400 KB schema dict takes milliseconds,
        and a request's constraint is checked, validated and looked up several times); setting
        a field computes it anew, but a schema dict changed in place afterwards is not seen.
        Not a dataclass field: neither compared, shown nor sent to the engine core.
        """
        key = self.__dict__.get("_key")
        if key is None:
            key = self.__dict__["_key"] = self._make_key()
        return key

    @property
    def digest(self) -> bytes:
        """SHA-256 of ``key`` (32 bytes), computed once per object as ``key`` is."""
        digest = self.__dict__.get("_digest")
        if digest is None:
            kind, spec = self.key
            digest = self.__dict__["_digest"] = hashlib.sha256(
                f"{kind}:{spec}".encode(errors="surrogatepass")).digest()
        return digest

    def _make_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind in ("json", "structural_tag"):
            value = getattr(self, kind)
            spec = value if isinstance(value, str) else \
                json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        elif kind == "choice":
            spec = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict | None
                   ) -> StructuredOutputsParams | None:
        """Accept the params object itself or its fields as a dict (JSON bodies, kwargs).

        Raises:
            ValueError: for a dict with an unknown field or fields the constructor rejects
                (none or several constraints, a wrong type), or a value of any other type.
        """
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"json_object", *_SPEC_FIELDS}
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown field(s) "
                                 f"{sorted(unknown)}")
            return cls(**value)
        raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams "
                         f"or a dict, got {type(value).__name__}")
