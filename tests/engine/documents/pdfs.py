"""Small PDFs written byte by byte for the tests: a sound one with text on each page, and hostile ones."""

from __future__ import annotations

import zlib


def _pdf(objects: list[bytes]) -> bytes:
    """Objects 1..n (object 1 the catalog) -> a PDF with a correct cross-reference table."""
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return bytes(out)


def text_pdf(pages: list[list[str]]) -> bytes:
    """One page per list of lines, in Helvetica, each line on its own baseline."""
    n = len(pages)
    page_ids = [4 + 2 * i for i in range(n)]
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{' '.join(f'{p} 0 R' for p in page_ids)}] /Count {n} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, lines in enumerate(pages):
        ops = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({line}) Tj T*" for line in lines) + " ET"
        stream = ops.encode()
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            f"/Contents {page_ids[i] + 1} 0 R >>".encode()
        )
        objects.append(f"<< /Length {len(stream)} >>\nstream\n".encode() + stream + b"\nendstream")
    return _pdf(objects)


def bomb_pdf(expanded: int = 200 * 1024 * 1024) -> bytes:
    """A page whose content stream inflates to `expanded` bytes from a few hundred kilobytes."""
    stream = zlib.compress(b" " * expanded, 9)
    return _pdf(
        [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
            f"<< /Length {len(stream)} /Filter /FlateDecode >>\nstream\n".encode() + stream + b"\nendstream",
        ]
    )


def nested_pdf(depth: int = 100_000) -> bytes:
    """A catalog holding an array nested `depth` deep."""
    return _pdf([b"<< /Type /Catalog /Pages 2 0 R /Deep " + b"[" * depth + b"]" * depth + b" >>",
                 b"<< /Type /Pages /Kids [] /Count 0 >>"])  # fmt: skip


def encrypted_pdf() -> bytes:
    import io

    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(text_pdf([["secret"]]))))
    writer.encrypt("password")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()
