"""Voice notes to text through an OpenAI-compatible `/audio/transcriptions` endpoint
(OpenAI, or a local Whisper server), with the openai client; each call counted in the
usage ledger (kind "transcription") before its text is handed back."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio.to_thread
from loguru import logger

from gateway.media.errors import MediaError
from gateway.usage.meter import UsageMeter, count_transcription

# The openai client is imported and made at the first voice note: most turns have none,
# and a one-shot `gateway chat -m` should not pay for loading it.
if TYPE_CHECKING:
    import openai
    from openai.types.audio.transcription import Transcription

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
    from openai.types.audio.transcription import UsageDuration, UsageTokens

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
        self._base_url = base_url
        self._api_key = api_key or NO_KEY
        self._timeout = timeout
        self._client: openai.AsyncOpenAI | None = None
        self._connecting = threading.Lock()

    def _connect(self) -> openai.AsyncOpenAI:
        """The client, made once (in a worker thread: it reads the CA certificates)."""
        with self._connecting:
            if self._client is None:
                import openai

                self._client = openai.AsyncOpenAI(
                    base_url=self._base_url,
                    api_key=self._api_key,
                    timeout=self._timeout,
                    max_retries=2,
                )
            return self._client

    async def transcribe(self, data: bytes, *, name: str, mime_type: str) -> Transcript:
        """The spoken text. Raises MediaError when the server refuses or fails."""
        client = self._client
        if client is None:
            client = await anyio.to_thread.run_sync(self._connect)
        import openai  # loaded by now (by the provider, or by _connect in its thread)

        try:
            result = await client.audio.transcriptions.create(
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
        if self._client is not None:
            await self._client.close()
