"""A command's output as the agent sees it: the first bytes and the last, with a marker for
what was cut, kept while the command runs without holding the whole stream."""


def capped_text(head, tail, total, tail_cap):
    """The kept head and tail of a stream of ``total`` bytes, with a marker for the cut."""
    if len(tail) > tail_cap:
        del tail[: len(tail) - tail_cap]
    omitted = total - len(head) - len(tail)
    text = head.decode("utf-8", "replace")
    if omitted > 0:
        text += f"\n[... {omitted} bytes of output omitted ...]\n"
    return text + tail.decode("utf-8", "replace")


def keep_head_tail(head, tail, chunk, head_cap, tail_cap):
    """Add ``chunk`` of a command's output to its kept head (up to ``head_cap`` bytes) and
    tail (trimmed to about ``tail_cap`` bytes): bytearrays, extended in place."""
    if len(head) < head_cap:
        take = head_cap - len(head)
        head += chunk[:take]
        chunk = chunk[take:]
    if chunk:
        tail += chunk
        if len(tail) > 2 * tail_cap + (1 << 16):
            del tail[: len(tail) - tail_cap]
