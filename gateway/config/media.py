"""`[media]`: images, voice notes and documents people send, and files in replies."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator

from gateway.config.section import Section, secret, secret_file


class MediaSettings(Section):
    """`[media]`: images, voice notes and documents people send, and files in replies."""

    enabled: bool = Field(True, description="Read images, voice messages and documents.")
    max_download_mb: float = Field(
        20.0,
        gt=0,
        le=2000,
        description="Largest file fetched (a platform may allow its bots less).",
    )
    image_max_side: int = Field(
        2048, ge=64, le=16384, description="Longer images are scaled down to this many pixels."
    )
    image_max_kb: int = Field(
        2048, ge=16, description="Larger images are re-encoded (JPEG) to fit under this size."
    )
    image_max_megapixels: float = Field(
        50.0, gt=0, description="Larger images are refused (decompression bombs)."
    )
    vision_models: list[str] = Field(
        default_factory=lambda: [
            "gpt-4o*",
            "gpt-4.1*",
            "gpt-5*",
            "o3*",
            "o4*",
            "*vision*",
            "*-vl*",
            "llava*",
            "gemma3*",
            "claude*",
            "gemini*",
        ],
        description="Models that see images (glob patterns); others get a short note instead.",
    )
    document_max_chars: int = Field(
        20_000,
        ge=100,
        description="Text taken from one document (PDF, DOCX, text); reading stops there.",
    )
    document_max_unpacked_mb: float = Field(
        50.0,
        gt=0,
        le=2000,
        description="A DOCX whose parts, or a PDF whose one stream, expand to more than "
        "this is refused (zip and stream bombs); sizes are counted, not taken on trust.",
    )
    document_max_ratio: float = Field(
        500.0,
        ge=2,
        description="A DOCX part over 1 MB that expands to more than this many times its "
        "packed size is refused: a zip bomb's trait (deflate's most is about 1,000; Word's "
        "styles part is 32, a document of one line repeated 30,000 times 307).",
    )
    document_max_pages: int = Field(
        500, ge=1, description="PDF pages read at most; the model is told where reading stopped."
    )
    document_max_seconds: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Reading one PDF or DOCX stops here (the text so far is used); a "
        "reader stuck past it by 5 s is killed and the document refused.",
    )
    document_max_memory_mb: int = Field(
        512,
        ge=128,
        description="Memory (address space) of the child process that reads one PDF or "
        "DOCX; reading a document that needs more is refused.",
    )
    document_readers: int = Field(
        2, ge=1, le=64, description="PDF and DOCX files read at once (one child process each)."
    )
    transcription_model: str = Field(
        "whisper-1", description="Model of the /audio/transcriptions endpoint for voice messages."
    )
    transcription_base_url: str | None = Field(
        None,
        description="OpenAI-compatible server for transcriptions; unset = llm.base_url.",
        examples=["http://127.0.0.1:8000/v1"],
    )
    transcription_api_key: SecretStr | None = secret(
        "the transcription server's key (unset: llm's key when the server is llm's, else none)",
        "GATEWAY_MEDIA__TRANSCRIPTION_API_KEY",
    )
    transcription_api_key_file: Path | None = secret_file(
        "GATEWAY_MEDIA__TRANSCRIPTION_API_KEY", "transcription-api-key"
    )
    transcription_timeout: float = Field(
        120.0, gt=0, description="Seconds one transcription may take."
    )
    code_block_file_chars: int = Field(
        4000,
        ge=0,
        description="A reply's code block longer than this goes out as a file (0: never).",
    )

    @model_validator(mode="after")
    def _check(self) -> MediaSettings:
        # The reader holds the whole file, and a Python with pypdf and lxml takes ~60 MB.
        if self.document_max_memory_mb < self.max_download_mb * 2 + 100:
            raise ValueError(
                f"document_max_memory_mb = {self.document_max_memory_mb} is too little to read "
                f"a {self.max_download_mb:g} MB file (max_download_mb): give at least "
                f"{self.max_download_mb * 2 + 100:.0f}"
            )
        return self
