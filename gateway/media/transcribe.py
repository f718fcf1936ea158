"""Voice notes to text through an OpenAI-compatible `/audio/transcriptions` endpoint
(OpenAI, or a local Whisper server), with the openai client."""

from __future__ import annotations

import openai
from loguru import logger

from gateway.media.errors import MediaError

#: Placeholder key for servers that want none (a local Whisper); the client needs one.
NO_KEY = "no-key"


class Transcriber:
    """Turns audio bytes into text with one model on one server."""

    def __init__(
        self, *, base_url: str | None, api_key: str | None, model: str, timeout: float
    ) -> None:
        self.model = model
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or NO_KEY, timeout=timeout, max_retries=2
        )

    async def transcribe(self, data: bytes, *, name: str, mime_type: str) -> str:
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
        return result.text.strip()

    async def aclose(self) -> None:
        await self._client.close()
