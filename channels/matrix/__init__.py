"""Matrix: the adapter (`channel`: matrix-nio, a `/sync` loop that stores its token only
after the journal) and its formatter (`format`: the model's Markdown as Matrix HTML, split
under the event size limit). matrix-nio loads only when the channel runs."""

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
