"""The supervisor's request and answer framing over raw descriptors (no text streams)."""

from __future__ import annotations

import os
import threading

from tandem.agent_env.sandbox.inside.supervisor import request_lines, send_line


def _feed(chunks: list[bytes]) -> list[bytes]:
    """The lines request_lines yields when ``chunks`` arrive one write at a time."""
    r, w = os.pipe()
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(request_lines(r)))
    reader.start()
    try:
        for chunk in chunks:
            os.write(w, chunk)
    finally:
        os.close(w)
    reader.join(10)
    os.close(r)
    return lines


def test_lines_split_and_joined_across_reads() -> None:
    chunks = [b'{"a": 1}\n{"b"', b": 2}\n", b'{"c": ', b"3", b"}\n{", b'"d": 4}\n\n']
    assert _feed(chunks) == [b'{"a": 1}', b'{"b": 2}', b'{"c": 3}', b'{"d": 4}', b""]


def test_a_line_cut_off_by_the_end_of_the_stream_is_dropped() -> None:
    assert _feed([b"one\ntwo"]) == [b"one"]


def test_a_large_request_arrives_whole() -> None:
    big = b"x" * (3 << 20)  # several pipe buffers and reads
    assert _feed([big[: 1 << 20], big[1 << 20 :] + b"\nnext\n"]) == [big, b"next"]


def test_send_line_writes_all_of_a_large_answer() -> None:
    r, w = os.pipe()
    got: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(r, 1 << 16):
            got.append(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    text = "é" * (1 << 20)  # more than a pipe holds: written in several write(2) calls
    send_line(w, text)
    os.close(w)
    reader.join(10)
    os.close(r)
    assert b"".join(got) == (text + "\n").encode()
