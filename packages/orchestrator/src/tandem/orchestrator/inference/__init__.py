"""The inference side: the policy's tokens and the engines that generate them.

`tokenizer` (byte-level, with special tokens for roles and tool calls), `chat_format`
(conversations rendered to exact token ids, tool calls parsed back), `template_chat` (the
same with a checkpoint's own tokenizer and chat template; `tool_prompt`: tools, calls and
results as plain text for a template without tool syntax), `formats` (which of the two a
policy directory speaks, `chat_format_for`), `call_prefix` (the check that stops a turn
once it can no longer become a well-formed call) and the embedded
engine (`embedded/`: continuous batching over KV-cache slots, prefix sharing, and the
asyncio server through which episodes drive it, the `Engine` protocol).
"""
