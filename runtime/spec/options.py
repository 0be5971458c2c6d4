"""The serve options for speculation, resolved against the artifact's recorded draft.

    --speculative off | ngram[:MAX_N] | early_exit[:N] | draft_model[:PATH] | hidden_draft[:HEAD]
    --num-speculative-tokens K

Without --speculative an artifact quantized with `--draft` speculates with its draft and
k by default; anything else does not speculate. A bare proposer name takes its settings
(layers, head, draft path) from the artifact when the artifact's draft is of that kind.
"""

from __future__ import annotations

from .proposer import SpeculativeConfig, make_config, proposer_names

# The option after "NAME:" sets this proposer option (a registry, not a name switch).
ARGUMENT_OPTION = {"ngram": ("max_n", int), "early_exit": ("num_layers", int),
                   "draft_model": ("path", str), "hidden_draft": ("head", str)}
OFF = ("off", "none")


def resolve_speculative(choice: str | None, num_tokens: int | None,
                        artifact_draft: dict | None) -> SpeculativeConfig | None:
    """`artifact_draft`: quantize.artifact_reader.artifact_draft(path) (None if absent)."""
    from ..formats.draft_entry import speculative_options

    default = speculative_options(artifact_draft) if artifact_draft else None
    if choice is None and default is None:
        if num_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative PROPOSER (this "
                             "artifact records no draft).")
        return None
    if choice is not None and choice.lower() in OFF:
        return None
    if choice is None:
        name, k, options = default
        return make_config(name, num_tokens or k, **options)
    name, _, arg = choice.partition(":")
    if name not in proposer_names():
        raise ValueError(f"--speculative {choice!r}: unknown proposer {name!r}; choose one of "
                         f"{', '.join(proposer_names())}, or off.")
    options, k = {}, 4
    if default is not None and default[0] == name:
        _, k, options = default
    if arg:
        key, cast = ARGUMENT_OPTION[name]
        try:
            options[key] = cast(arg)
        except ValueError:
            raise ValueError(f"--speculative {choice!r}: {arg!r} is not a valid {key}.") from None
    return make_config(name, num_tokens or k, **options)
