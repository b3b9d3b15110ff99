"""An image of a prompt on the wire (``NewRequest.images``): what the gateway's processor made of it."""

from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One image of a prompt, as the gateway's processor made it (the worker never sees encoded
    bytes): its pixel values, where its tokens sit in the prompt, and a digest of its pixels that
    keys the prefix-cache blocks holding them (equal digests: the same image)."""

    digest: str  # sha256 of the pixel values and their shapes, hex: mixed into the keys of the blocks its tokens are in
    offset: int  # first prompt position of its tokens (placeholders and any markers the processor put around them)
    length: int  # how many prompt positions, from ``offset``, its expansion covers
    pixels: bytes  # float32, little-endian, C order
    shape: list[int]  # of ``pixels``: what the processor's ``pixel_values`` gave for this image alone
    extra: dict[str, list[int]] = {}  # the processor's other per-image outputs (``image_sizes``...), flattened
    extra_shapes: dict[str, list[int]] = {}


def token_runs(ids: list[int], tokens: set[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of ``ids`` made of ``tokens`` only, in order: an image's runs of
    placeholders, as the gateway places images and the worker opens their attention."""
    runs: list[tuple[int, int]] = []
    for p, token in enumerate(ids):
        if token not in tokens:
            continue
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
