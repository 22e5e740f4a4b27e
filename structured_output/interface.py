"""The grammar-backend plugin kind: a GrammarBackend compiles a spec into a
Grammar, a per-request matcher that masks the tokens it cannot accept.

Every backend writes the same bitmask layout, so one tensor serves a batch
whose requests use different backends: int32 rows of ceil(vocab_size / 32)
words, bit `j` of word `i` set <=> token `32 * i + j` is allowed (the layout of
xgrammar and llguidance alike).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import StructuredOutputConfig


# NOTE: not a StrEnum: f"{kind}" reads "StructuredOutputKind.JSON" for grammar
# backends written against plugin API 1.0, and must keep doing so.
class StructuredOutputKind(str, enum.Enum):  # noqa: UP042
    """What a spec is; the value is the StructuredOutputsParams field name."""

    JSON = "json"  # a JSON schema (canonical JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (spec is "")
    REGEX = "regex"
    CHOICE = "choice"  # a JSON list of strings
    GRAMMAR = "grammar"  # EBNF (GBNF), root rule `root`
    STRUCTURAL_TAG = "structural_tag"  # a JSON object


class Grammar(ABC):
    """One request's matcher state over a compiled grammar.

    NOTE: the speculative-decoding contract: `validate_tokens` never changes
    the state; `accept_tokens` advances it by exactly the tokens accepted, and
    `rollback(n)` undoes the last `n` accepted tokens.
    """

    @abstractmethod
    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids` in order; stop at the first token the
        grammar rejects and return False (the tokens before it stay accepted)."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar would accept from
        here, without advancing (proposed draft tokens are checked with it)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (layout: module doc).
        The stop (EOS) token is allowed only where the grammar can end."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted its stop token: the request is done."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the initial state (no token accepted)."""

    @abstractmethod
    def fork(self) -> Grammar:
        """An independent Grammar in this one's state, sharing the compiled
        grammar (cheap). The manager caches one never-advanced Grammar per
        spec and forks it for every request."""


class GrammarBackend(ABC):
    """Compiles specs into Grammars for one tokenizer and vocabulary.

    Registered under the plugin kind ``grammar_backend``; built lazily in the
    engine core when the first request that names it arrives, with the HF
    tokenizer and the MODEL's vocab size (the logits' width, which may exceed
    the tokenizer's: ids past the tokenizer are never allowed).

    `compile` runs on the manager's thread pool, several at a time: it must be
    thread-safe. `validate` is a classmethod: the API process calls it before
    a request is scheduled, in a child process under
    `structured_output.compile_timeout_s` (killed past it), and then compiles
    the spec there too when the model's vocabulary is known (so the class
    must be importable by its module path).

    Whitespace: `any_whitespace=False` means JSON without free whitespace.
    A `validate` / `compile` whose signature names `max_whitespace` (plugin
    API 1.1) is also passed it (int >= 1, or None = unbounded): the longest
    whitespace run its JSON grammars allow between two tokens. One that does
    not is called as under API 1.0, and its JSON whitespace stays unbounded
    unless the limit is 0 (sent as any_whitespace=False).
    """

    #: The registered name (also the first element of the manager's cache key).
    name: ClassVar[str] = ""
    #: The kinds this backend compiles; `validate` rejects any other.
    supported_kinds: ClassVar[frozenset[StructuredOutputKind]] = frozenset(StructuredOutputKind)

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_id: int | None,
        config: StructuredOutputConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.config = config

    @classmethod
    @abstractmethod
    def validate(cls, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True) -> None:
        """Raise InvalidRequestError (field ``structured_outputs.<kind>``, the
        spec, and what is wrong) if `spec` cannot be compiled by this backend."""

    @abstractmethod
    def compile(self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True) -> Grammar:
        """A Grammar for `spec` in its initial state; raises on a bad spec."""

    def serialize(self, grammar: Grammar) -> bytes | None:
        """`grammar` (just compiled, never advanced) as bytes that `deserialize`
        of a backend built with the same tokenizer, vocab size and config
        turns back into it, or None (the default: not supported, or not
        worth it for this grammar). Plugin API 1.8: the API side's validator
        compiles a slow spec once and the engine core loads the result
        instead of compiling it again."""
        return None

    def deserialize(self, kind: StructuredOutputKind, spec: str, data: bytes) -> Grammar:
        """The Grammar `serialize` wrote for (`kind`, `spec`), in its initial
        state. Raises if `data` is not this backend's (the engine core then
        compiles the spec itself)."""
        raise NotImplementedError(f"the {self.name or type(self).__name__} grammar backend cannot deserialize")

    def allocate_bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        from pagedllm.structured_output.bitmask import allocate_token_bitmask

        return allocate_token_bitmask(num_rows, vocab_size)

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing
        """Release what the backend holds (thread pools, caches)."""
