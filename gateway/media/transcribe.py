"""Voice notes to text through an OpenAI-compatible `/audio/transcriptions` endpoint
(OpenAI, or a local Whisper server), with the openai client; each call counted in the
usage ledger (kind "transcription") before its text is handed back."""

from __future__ import annotations

from dataclasses import dataclass

import openai
from loguru import logger
from openai.types.audio.transcription import Transcription, UsageDuration, UsageTokens

from gateway.media.errors import MediaError
from gateway.usage import UsageMeter, count_transcription

#: Placeholder key for servers that want none (a local Whisper); the client needs one.
NO_KEY = "no-key"


@dataclass(frozen=True, slots=True)
class Transcript:
    """What the server heard, and what it says the call used: the audio's duration
    (models billed by the minute, e.g. whisper-1) or tokens (e.g. gpt-4o-transcribe);
    None and 0 when it does not say."""

    text: str
    audio_seconds: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0


def transcript_of(result: Transcription) -> Transcript:
    usage = result.usage
    text = result.text.strip()
    if isinstance(usage, UsageDuration):
        return Transcript(text, audio_seconds=float(usage.seconds))
    if isinstance(usage, UsageTokens):
        return Transcript(text, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)
    return Transcript(text)


class Transcriber:
    """Turns audio bytes into text with one model on one server."""

    def __init__(
        self,
        *,
        base_url: str | None,
        api_key: str | None,
        model: str,
        timeout: float,
        meter: UsageMeter | None = None,
    ) -> None:
        self.model = model
        self.meter = meter
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or NO_KEY, timeout=timeout, max_retries=2
        )

    async def transcribe(self, data: bytes, *, name: str, mime_type: str) -> Transcript:
        """The spoken text. Raises MediaError when the server refuses or fails."""
        try:
            result = await self._client.audio.transcriptions.create(
                model=self.model, file=(name, data, mime_type or "application/octet-stream")
            )
        except openai.APIStatusError as exc:
            logger.warning("transcription refused: HTTP {} {}", exc.status_code, exc.message)
            raise MediaError(
                f"the transcription service refused the recording (HTTP {exc.status_code})"
            ) from None
        except openai.APIError as exc:
            logger.warning("transcription failed: {}", type(exc).__name__)
            raise MediaError("the transcription service is not answering") from None
        transcript = transcript_of(result)
        if self.meter is not None:
            await count_transcription(
                self.meter,
                self.model,
                audio_seconds=transcript.audio_seconds,
                input_tokens=transcript.input_tokens,
                output_tokens=transcript.output_tokens,
            )
        return transcript

    async def aclose(self) -> None:
        await self._client.close()
