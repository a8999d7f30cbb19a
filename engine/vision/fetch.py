"""Pictures by http(s) URL, for a server started with `--allow-image-urls`: one GET, at most MAX_IMAGE_BYTES,
within a deadline for the whole transfer (a server that drips bytes is cut off), then decoded as any picture."""

from __future__ import annotations

import time

import httpx

from engine.vision.images import MAX_IMAGE_BYTES, DecodedImage, ImageError, decode_bytes

FETCH_TIMEOUT_S = 15.0
MAX_REDIRECTS = 3


def fetch_image(url: str, name: str = "The image URL", timeout_s: float = FETCH_TIMEOUT_S) -> DecodedImage:
    """The picture at an http(s) `url`; every failure is one ImageError sentence."""
    if not url.startswith(("http://", "https://")):
        raise ImageError(f"{name} is not an http or https URL.")
    deadline = time.monotonic() + timeout_s
    data = bytearray()
    try:
        with (
            httpx.Client(timeout=timeout_s, follow_redirects=True, max_redirects=MAX_REDIRECTS) as client,
            client.stream("GET", url) as reply,
        ):
            if reply.status_code != 200:
                raise ImageError(f"{name} answered HTTP {reply.status_code}.")
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_IMAGE_BYTES:
                raise ImageError(f"{name} holds more than {MAX_IMAGE_BYTES // 2**20} MB.")
            for chunk in reply.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ImageError(f"{name} holds more than {MAX_IMAGE_BYTES // 2**20} MB.")
                if time.monotonic() > deadline:
                    raise ImageError(f"{name} took longer than {timeout_s:g} s to arrive.")
    except httpx.HTTPError as exc:
        raise ImageError(f"{name} could not be fetched ({exc.__class__.__name__}).") from None
    return decode_bytes(bytes(data), name)
