"""Draft models (a Modelfile's DRAFT): whether a smaller model's tokens are the model's.

A draft model proposes tokens that the model then verifies (runner.speculative.draftmodel),
so a token id must mean the same text to both. llama.cpp's rule
(common_speculative_are_compatible in common/speculative.cpp) is applied at create time,
so a mismatched pair is a 400 then rather than a model that loads and never speeds up:
the same tokenizer type, the same BOS and EOS where they are added, vocabularies within
128 tokens of each other in size (a padded vocabulary), and the same text for every
token id both have from 5 on (the first few are control tokens that models name
differently).
"""

from __future__ import annotations

from corral.errors import InvalidModelFile, ModelfileError
from corral.registry.gguf import Vocabulary, read_vocabulary
from corral.registry.projector import is_projector
from corral.registry.store import Store

MAX_SIZE_DIFFERENCE = 128
CHECK_FROM = 5


def vocabulary_problem(model: Vocabulary, draft: Vocabulary) -> str | None:
    """Why `draft` cannot draft for `model`, or None."""
    if not model.tokens or not draft.tokens:
        return "the draft model or the model has no vocabulary"
    if model.model != draft.model:
        return f"its tokenizer is {draft.model!r} and the model's {model.model!r}"
    for what, ours, theirs, added in (
            ("BOS", model.bos, draft.bos, (model.add_bos, draft.add_bos)),
            ("EOS", model.eos, draft.eos, (model.add_eos, draft.add_eos))):
        # A flag the file leaves out is the tokenizer's default, which llama.cpp knows
        # and the metadata does not say: only two given flags are compared.
        if None not in added and added[0] != added[1]:
            return f"it {'adds' if added[1] else 'does not add'} a {what} token and the model " \
                   f"{'does' if added[0] else 'does not'}"
        if True in added and ours != theirs:
            return f"its {what} token differs from the model's"
    n_model, n_draft = len(model.tokens), len(draft.tokens)
    if abs(n_model - n_draft) > MAX_SIZE_DIFFERENCE:
        return f"it has {n_draft} tokens and the model {n_model}"
    for i in range(CHECK_FROM, min(n_model, n_draft)):
        if model.tokens[i] != draft.tokens[i]:
            return (f"its token {i} is {draft.tokens[i][:40]!r} where the model's is "
                    f"{model.tokens[i][:40]!r}")
    return None


def check_draft(store: Store, model_digest: str, draft_digest: str) -> None:
    """A stored draft blob against the model blob it drafts for, at create and at pull:
    ModelfileError (a 400) naming the first difference, InvalidModelFile where the draft
    is no GGUF."""
    try:
        if is_projector(store.gguf_info(draft_digest)):
            raise ModelfileError("the draft model is a vision projector, not a model")
        problem = vocabulary_problem(read_vocabulary(store.blob_path(model_digest)),
                                     read_vocabulary(store.blob_path(draft_digest)))
    except InvalidModelFile:
        raise InvalidModelFile("the draft model was not in GGUF format") from None
    if problem:
        raise ModelfileError(f"the draft model's vocabulary is not the model's: {problem}")
