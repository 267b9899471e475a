"""A local file's bytes and text, for the readers of fibctl.data.json_files and local_files.

A file is decompressed by what its first bytes say it is (gzip, bzip2, xz; zstd with the
zstandard package), whatever its name (`.GZ`, `.tgz`, `.gzip`: decompressed by extension
alone, such a file was read as text), else by its extension (`.gz`, `.bz2`, `.xz`, `.zst`:
a `.gz` file that is not gzip is refused by the decompressor). Its text is read as UTF-8, a
byte-order mark dropped. Refused, naming the file, are: a tar or zip archive (its headers are
not text to train on), UTF-16 text (with a byte-order mark or without: ASCII in UTF-16 is
valid UTF-8, a NUL beside each letter), binary data (many NULs; or not UTF-8 and many control
bytes: an image, a PDF), and a file that is not UTF-8 (naming the line of its first byte that
is not)."""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import lzma
import os
import re
from typing import IO

from fibctl.errors import FibctlError, shown_path

# the first bytes of each compressed format (bzip2's: "BZh", the block size, then the magic
# of a block or of the stream's end; its first three alone may begin a text)
_MAGIC = {"gzip": re.compile(rb"\x1f\x8b\x08"), "bzip2": re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"),
          "xz": re.compile(rb"\xfd7zXZ\x00"), "zstd": re.compile(rb"\x28\xb5\x2f\xfd")}
_EXTENSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}


def _open_zstd(path: str, mode: str) -> IO[bytes]:
    try:
        import zstandard
    except ImportError:
        raise FibctlError(f"{shown_path(path)} is zstd-compressed: reading it needs the zstandard package: "
                          "pip install zstandard (or decompress it: zstd -d)") from None
    return zstandard.open(path, mode)


_OPENERS = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open, "zstd": _open_zstd}


def _compression(path: str) -> str | None:
    """The format the file is compressed in, by its first bytes, else by its extension."""
    with open(path, "rb") as f:
        head = f.read(10)
    found = [name for name, magic in _MAGIC.items() if magic.match(head)]
    return found[0] if found else _EXTENSIONS.get(os.path.splitext(path)[1])


def open_binary(path: str) -> IO[bytes]:
    """The file's bytes, decompressed."""
    return _OPENERS.get(_compression(path), open)(path, "rb")


HEAD_BYTES = 8192  # of a file's (decompressed) bytes, looked at before its text is read
NUL_SHARE = 10  # a file whose first bytes are more than one NUL in this many is not text


def open_text(path: str, newline: str | None) -> IO[str]:
    """The file's text, decoded as UTF-8 (a byte-order mark dropped); `newline` as open's. A file
    whose first bytes are not text is refused, naming it."""
    with open_binary(path) as raw:  # opened again to be read: a zstd stream cannot seek back
        head = raw.read(HEAD_BYTES)
        while len(head) < HEAD_BYTES and (more := raw.read(HEAD_BYTES - len(head))):  # a zstd stream may read short
            head += more
    _check_head(path, head)
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", newline=newline)


def _check_head(path: str, head: bytes) -> None:
    """Refuse a file whose first bytes say it is not UTF-8 text."""
    name = shown_path(path)
    archive = "tar" if head[257:262] == b"ustar" else "zip" if head.startswith(b"PK\x03\x04") else None
    if archive:  # its member files' headers would be trained on as text
        packed = _compression(path)
        raise FibctlError(f"{name} is a {archive} archive{f' ({packed}-compressed)' if packed else ''}, "
                          "not text: unpack it and list its files")
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise FibctlError(f"{name} is UTF-16 text, not UTF-8; convert it (e.g. iconv -f utf-16 -t utf-8)")
    # ASCII in UTF-16 without a byte-order mark is valid UTF-8 with a NUL after (or before) each
    # letter; no text has many NULs, while one NUL in a text is still read as it is
    nuls = head.count(0)
    if nuls > 1 and nuls * NUL_SHARE > len(head):
        odd, even = head[1::2].count(0), head[0::2].count(0)
        order = "le" if odd > 9 * even else "be" if even > 9 * odd else None
        if order:
            raise FibctlError(f"{name} looks like UTF-16 text without a byte-order mark (a NUL byte beside each "
                              f"letter), not UTF-8; convert it (e.g. iconv -f utf-16{order} -t utf-8)")
        raise FibctlError(f"{name} looks like binary data, not text: {nuls:,} of its first {len(head):,} bytes "
                          "are NUL")
    # compressed or encoded data (an image, a PDF) has few NULs but is not UTF-8 and is full of
    # control bytes, which text in another encoding (latin1, cp1251: for iconv) has none of
    controls = len(head) - len(head.translate(None, _CONTROL_BYTES))
    if controls * CONTROL_SHARE > len(head) and not _utf8(head):
        raise FibctlError(f"{name} looks like binary data, not text: it is not UTF-8, and {controls:,} of its first "
                          f"{len(head):,} bytes are control bytes")


# bytes no text holds: C0 controls but for tab, line breaks, form feed and escape (ANSI colours)
_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1b")
CONTROL_SHARE = 30  # a file whose first bytes are more than one in this many such (and not UTF-8) is not text


def _utf8(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-8 (the last character may be cut by their end)."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


UTF8_SCAN_BYTES = 1 << 20  # read at a time to find a file's first byte that is not UTF-8


def not_utf8(path: str) -> str:
    """Why a file that failed to decode as UTF-8 is refused: the line, offset and value of its
    first byte that is not UTF-8 (read afresh: the decoder's error says where in its chunk), and
    what to do. A file that holds other UTF-8 text than ASCII around it is UTF-8 with a bad byte:
    converting it whole (iconv -f latin1) would garble every other letter that is not ASCII."""
    name = shown_path(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = lines = 0  # bytes and line breaks read before the chunk
    beyond_ascii = False  # UTF-8 text other than ASCII read before it
    with open_binary(path) as f:
        while True:
            chunk = f.read(UTF8_SCAN_BYTES)
            held = decoder.getstate()[0]  # the start of a character cut by the chunk's end: no line break
            try:
                beyond_ascii |= not decoder.decode(chunk, final=not chunk).isascii()
            except UnicodeDecodeError as e:  # in held + chunk
                before, after = e.object[:e.start], e.object[e.end:]
                line, offset = lines + before.count(b"\n") + 1, read - len(held) + e.start
                where = f"line {line} (byte 0x{e.object[e.start]:02x} at offset {offset:,})"
                if beyond_ascii or not before.isascii() or not after.decode("utf-8", "ignore").isascii():
                    return (f"{name}: {where} is not UTF-8, though the text around it is: fix that line "
                            "(converting the whole file from another encoding would garble the rest)")
                return (f"{name} is not UTF-8 text: {where}; if the whole file is in another encoding, "
                        "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8), else fix that line")
            if not chunk:
                return f"{name} is not UTF-8 text"  # it changed since it was read
            read, lines = read + len(chunk), lines + chunk.count(b"\n")
