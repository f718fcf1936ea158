"""Matrix: the adapter (`channel`: matrix-nio, a `/sync` loop that stores its token only
after the journal) and its formatter (`format`: the model's Markdown as Matrix HTML, split
under the event size limit). matrix-nio loads only when the channel runs."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.matrix.channel import (
        ENCRYPTED_REFUSAL,
        Identity,
        MatrixChannel,
        MatrixSetupError,
        Notice,
        Pacing,
        RoomFacts,
        Skip,
        check_credentials,
        parse_target,
        transaction_id,
        translate_event,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "ENCRYPTED_REFUSAL",
            "Identity",
            "MatrixChannel",
            "MatrixSetupError",
            "Notice",
            "Pacing",
            "RoomFacts",
            "Skip",
            "check_credentials",
            "parse_target",
            "transaction_id",
            "translate_event",
        ),
    },
)

__all__ = [
    "ENCRYPTED_REFUSAL",
    "Identity",
    "MatrixChannel",
    "MatrixSetupError",
    "Notice",
    "Pacing",
    "RoomFacts",
    "Skip",
    "check_credentials",
    "parse_target",
    "transaction_id",
    "translate_event",
]
