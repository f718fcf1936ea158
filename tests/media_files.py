"""Real files for media tests, made on the spot: images (Pillow), a PDF with text, a DOCX
(python-docx), and "speech" the fake transcription server reads."""

from __future__ import annotations

import dataclasses
import io
import random
import struct
import zipfile
import zlib
from dataclasses import dataclass

import docx
from PIL import Image


def png(width: int = 64, height: int = 48, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def noisy_png(width: int, height: int, seed: int = 7) -> bytes:
    """A PNG that does not compress (random pixels): large for its size in pixels."""
    rng = random.Random(seed)
    image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def pdf(*pages: str) -> bytes:
    """A minimal valid PDF with one line of Helvetica text per page."""
    objects: list[bytes] = []
    page_ids = []
    font_id = 3 + 2 * len(pages)
    for index, text in enumerate(pages):
        page_id, content_id = 3 + 2 * index, 4 + 2 * index
        page_ids.append(page_id)
        stream = f"BT /F1 18 Tf 72 720 Td ({text}) Tj ET".encode()
        objects.append(
            f"{page_id} 0 obj << /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 {font_id} 0 R >> >> /Contents {content_id} 0 R >> "
            "endobj\n".encode()
        )
        objects.append(
            f"{content_id} 0 obj << /Length {len(stream)} >> stream\n".encode()
            + stream
            + b"\nendstream endobj\n"
        )
    kids = " ".join(f"{i} 0 R" for i in page_ids)
    head = [
        b"1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n",
        f"2 0 obj << /Type /Pages /Kids [{kids}] /Count {len(pages)} >> endobj\n".encode(),
    ]
    font = f"{font_id} 0 obj << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> endobj\n"
    body = io.BytesIO()
    body.write(b"%PDF-1.4\n")
    offsets = []
    for obj in [*head, *objects, font.encode()]:
        offsets.append(body.tell())
        body.write(obj)
    xref = body.tell()
    body.write(f"xref\n0 {len(offsets) + 1}\n0000000000 65535 f \n".encode())
    body.write(b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets))
    body.write(
        f"trailer << /Size {len(offsets) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return body.getvalue()


def docx_file(*paragraphs: str) -> bytes:
    document = docx.Document()
    for paragraph in paragraphs:
        document.add_paragraph(paragraph)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def speech(text: str) -> bytes:
    """OGG-looking bytes that the fake transcription server hears as `text`."""
    return b"OggS\x00\x02" + b"\x00" * 20 + b"SPEECH:" + text.encode()


# --------------------------------------------------------------------------- bombs
# Made at test time and small on disk: a deflate stream of one chunk repeated (a full
# flush after the chunk makes its compressed form the same every time), written into a
# zip by hand so the headers can say what an attacker wants them to say.

_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


@dataclass(frozen=True, slots=True)
class ZipMember:
    """One member of a hand-written zip: its raw deflate bytes, its real inflated size
    and CRC, and the size its headers declare (a lie when it differs from `size`)."""

    name: str
    compressed: bytes
    size: int
    crc: int
    declared_size: int | None = None
    method: int = zipfile.ZIP_DEFLATED


def deflated(name: str, data: bytes) -> ZipMember:
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    return ZipMember(name, packer.compress(data) + packer.flush(), len(data), zlib.crc32(data))


def _repeated_deflate(head: bytes, chunk: bytes, times: int, tail: bytes) -> bytes:
    """Raw deflate of head + chunk * times + tail, with the chunk's compressed form
    stored once per repeat (about 1,000 times smaller than what it inflates to)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    start = packer.compress(head) + packer.flush(zlib.Z_FULL_FLUSH)
    body = packer.compress(chunk) + packer.flush(zlib.Z_FULL_FLUSH)
    return start + body * times + packer.compress(tail) + packer.flush()


def repeated(name: str, head: bytes, chunk: bytes, times: int, tail: bytes) -> ZipMember:
    """A member that inflates to head + chunk * times + tail."""
    crc = zlib.crc32(head)
    for _ in range(times):
        crc = zlib.crc32(chunk, crc)
    size = len(head) + len(chunk) * times + len(tail)
    return ZipMember(name, _repeated_deflate(head, chunk, times, tail), size, zlib.crc32(tail, crc))


def raw_zip(members: list[ZipMember]) -> bytes:
    """A zip whose local and central headers declare each member's `declared_size`."""
    out = io.BytesIO()
    central = b""
    for member in members:
        offset = out.tell()
        name = member.name.encode()
        size = member.size if member.declared_size is None else member.declared_size
        fields = (member.method, 0, 0x21, member.crc, len(member.compressed), size)
        out.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, *fields, len(name), 0))
        out.write(name + member.compressed)
        central += struct.pack(
            "<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, *fields, len(name), 0, 0, 0, 0, 0, offset
        )
        central += name
    start = out.tell()
    out.write(central)
    count = len(members)
    out.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(central), start, 0))
    return out.getvalue()


def docx_members(*paragraphs: str) -> list[ZipMember]:
    """The members of a real DOCX (python-docx's), to add a bomb to."""
    with zipfile.ZipFile(io.BytesIO(docx_file(*paragraphs))) as archive:
        return [deflated(info.filename, archive.read(info)) for info in archive.infolist()]


def docx_bomb(
    megabytes: int, *, declared_size: int | None = None, filler: bytes = b"<w:p/>"
) -> bytes:
    """A DOCX whose word/document.xml inflates to about `megabytes` MB: one paragraph of
    text, then `filler` repeated. `declared_size` makes its headers lie about the size."""
    head = (
        f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n<w:document xmlns:w="{_W}">'
        "<w:body><w:p><w:r><w:t>Before the bomb</w:t></w:r></w:p>"
    ).encode()
    chunk = filler * (1024 * 1024 // len(filler))
    bomb = repeated(
        "word/document.xml", head, chunk, megabytes, b"<w:sectPr/></w:body></w:document>"
    )
    if declared_size is not None:
        bomb = dataclasses.replace(bomb, declared_size=declared_size)
    members = [m for m in docx_members() if m.name != "word/document.xml"]
    return raw_zip([*members, bomb])


def zip_bomb_member(name: str, megabytes: int) -> ZipMember:
    """A member of `megabytes` MB of zeros (deflate's best ratio, about 1:1000)."""
    return repeated(name, b"", bytes(1024 * 1024), megabytes, b"")


def docx_with_nested_bomb(*paragraphs: str, megabytes: int = 1024) -> bytes:
    """A real DOCX that carries an embedded workbook (a zip in the zip) whose sheet
    inflates to `megabytes` MB: the document's own text is harmless."""
    inner = raw_zip([zip_bomb_member("xl/worksheets/sheet1.xml", megabytes)])
    embedded = deflated("word/embeddings/Microsoft_Excel_Worksheet.xlsx", inner)
    return raw_zip([*docx_members(*paragraphs), embedded])


def pdf_object_stream_bomb(megabytes: int, streams: int = 1, *, padding: bytes = b" ") -> bytes:
    """A PDF 1.5 with one page per object stream (FlateDecode), each stream padded to
    inflate to `megabytes` MB: a reader decodes a whole stream to get one object of it.
    Padding of spaces is slow for pypdf too (it skips whitespace a byte at a time: about
    5 MB/s); padding of a comment costs only memory. Objects: 1 catalog, 2 page tree,
    then the pages, their contents, the object streams and the cross-reference stream."""
    pages = [3 + i for i in range(streams)]
    contents = [page + streams for page in pages]
    holders = [content + streams for content in contents]
    xref_id = 3 + 3 * streams
    font = "<< /F1 << /Type /Font /Subtype /Type1 /BaseFont /Helvetica >> >>"
    kids = " ".join(f"{p} 0 R" for p in pages)
    where: dict[int, tuple[int, int]] = {}  # object -> (object stream, index in it)
    body = b"%PDF-1.5\n"
    offsets: dict[int, int] = {}
    for index, (page, content) in enumerate(zip(pages, contents, strict=True)):
        held = {
            page: f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font {font} >> /Contents {content} 0 R >>"
        }
        if index == 0:
            catalog = {1: "<< /Type /Catalog /Pages 2 0 R >>"}
            held = catalog | {2: f"<< /Type /Pages /Kids [{kids}] /Count {streams} >>"} | held
        table, objects = "", ""
        for position, (number, text) in enumerate(held.items()):
            where[number] = (holders[index], position)
            table += f"{number} {len(objects)} "
            objects += text + "\n"
        head = (table + objects).encode()
        line = (padding * (1024 * 1024))[: 1024 * 1024 - 1] + b"\n"
        data = _zlib_repeated(head, line, megabytes)
        stream = f"BT /F1 18 Tf 72 720 Td (Page {index + 1} of the bomb) Tj ET".encode()
        offsets[content] = len(body)
        body += f"{content} 0 obj << /Length {len(stream)} >> stream\n".encode()
        body += stream + b"\nendstream endobj\n"
        offsets[holders[index]] = len(body)
        body += (
            f"{holders[index]} 0 obj << /Type /ObjStm /N {len(held)} /First {len(table)} "
            f"/Filter /FlateDecode /Length {len(data)} >> stream\n"
        ).encode()
        body += data + b"\nendstream endobj\n"
    offsets[xref_id] = len(body)
    rows = b"\x00\x00\x00\x00\x00\xff\xff"
    for number in range(1, xref_id + 1):
        if number in where:
            holder, index = where[number]
            rows += struct.pack(">BLH", 2, holder, index)
        else:
            rows += struct.pack(">BLH", 1, offsets[number], 0)
    body += (
        f"{xref_id} 0 obj << /Type /XRef /Size {xref_id + 1} /W [1 4 2] /Root 1 0 R "
        f"/Length {len(rows)} >> stream\n"
    ).encode()
    body += rows + b"\nendstream endobj\n"
    return body + f"startxref\n{offsets[xref_id]}\n%%EOF\n".encode()


def _zlib_repeated(head: bytes, chunk: bytes, times: int) -> bytes:
    """head + chunk * times as a zlib stream (FlateDecode), small on disk."""
    adler = zlib.adler32(head)
    for _ in range(times):
        adler = zlib.adler32(chunk, adler)
    deflate = _repeated_deflate(head, chunk, times, b"")
    return b"\x78\xda" + deflate + struct.pack(">L", adler)
