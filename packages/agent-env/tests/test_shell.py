"""The `bash` tool's persistent shell: terminal-like state, restarts that keep it, cleanup."""

from __future__ import annotations

import asyncio
import json

import msgspec

from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks

TASK = generate_tasks(5, 1)[0]


def bash(command: str) -> ToolCall:
    return ToolCall("bash", json.dumps({"command": command}))


async def _run(config: EnvConfig, calls: list[ToolCall]) -> list[str]:
    env = Env(TASK, config)
    await env.reset()
    try:
        return [(await env.step(c)).observation.content for c in calls]
    finally:
        await env.close()


def run(config: EnvConfig, calls: list[ToolCall]) -> list[str]:
    return asyncio.run(_run(config, calls))


def test_cwd_variables_and_functions_persist_between_calls(config: EnvConfig) -> None:
    out = run(
        config,
        [
            bash("mkdir -p sub/dir && cd sub/dir && export GREETING='héllo wörld'; LOCAL=7"),
            bash('pwd; echo "$GREETING $LOCAL"; greet() { echo "fn:$1"; }'),
            bash("greet x; cd ..; pwd"),
            bash("pwd"),
        ],
    )
    assert out[0] == "[exit code 0]"
    assert out[1].splitlines()[:2] == ["/workspace/sub/dir", "héllo wörld 7"]
    assert out[2].splitlines()[:2] == ["fn:x", "/workspace/sub"]
    assert out[3].splitlines()[0] == "/workspace/sub"


def test_exit_and_kill_restart_the_shell_keeping_cwd_exports_and_files(
    config: EnvConfig,
) -> None:
    out = run(
        config,
        [
            bash("mkdir d && cd d && export KEEP=yes"),
            bash("echo data > f.txt; exit 3"),
            bash('pwd; echo "KEEP=$KEEP"; cat f.txt'),
            bash("kill -9 $$"),
            bash('pwd; echo "KEEP=$KEEP"'),
        ],
    )
    assert "exit code 3" in out[1] and "the shell exited" in out[1]
    assert out[2].splitlines()[:3] == ["/workspace/d", "KEEP=yes", "data"]
    assert "killed by SIGKILL" in out[3] and "a new one will start in /workspace/d" in out[3]
    assert out[4].splitlines()[:2] == ["/workspace/d", "KEEP=yes"]


def test_a_wedged_shell_is_killed_and_replaced(config: EnvConfig) -> None:
    limits = msgspec.structs.replace(config.sandbox.limits, command_timeout_s=2.0)
    short = msgspec.structs.replace(
        config, sandbox=msgspec.structs.replace(config.sandbox, limits=limits)
    )
    out = run(
        short,
        [
            bash("cd tests; export K=1"),
            bash("cd ..; read -r x < /dev/zero"),  # no newline ever: hangs
            bash('pwd; echo "K=$K"'),
        ],
    )
    assert "killed: still running after 2 s" in out[1] and "was killed" in out[1]
    # the state the last completed command left (the hung one never finished its `cd ..`)
    assert out[2].splitlines()[:2] == ["/workspace/tests", "K=1"]


def test_background_processes_end_with_their_command(config: EnvConfig) -> None:
    out = run(
        config,
        [
            bash("sleep 300 & setsid sleep 301 & (sleep 302 &); echo started"),
            bash("ps -eo args= | grep -c '^sleep 30' || true"),
        ],
    )
    assert out[0].startswith("started")
    assert out[1].splitlines()[0] == "0"  # nothing left running, not even the setsid one
    assert "Killed" not in out[1]  # no job notices leak into the next command's output


def test_odd_commands_are_reported_not_fatal(config: EnvConfig) -> None:
    out = run(
        config,
        [
            bash("echo 'unbalanced"),
            bash("printf 'é\\n'; echo ü >&2; echo done"),
            bash("echo a\u0000b"),
            bash("cat; echo stdin-is-empty"),
        ],
    )
    assert "unexpected EOF" in out[0] and "exit code 2" in out[0]
    assert out[1].splitlines()[:3] == ["é", "ü", "done"]
    assert out[2].startswith("error:") and "NUL" in out[2]
    assert out[3].startswith("stdin-is-empty")


def test_orphans_are_reaped_while_a_command_runs(config: EnvConfig) -> None:
    # each subshell exits at once and leaves its `sleep` to the sandbox's init: far more of
    # them over the call than the pids limit allows at a time, so their zombies must be
    # collected while the command is still running, by the shell and by `run_tests` alike
    orphans = config.sandbox.limits.pids * 3
    loop = f"for i in $(seq {orphans}); do (sleep 0.01 &); done; sleep 0.3"
    count = "ls /proc | grep -c '^[0-9]'"
    task = msgspec.structs.replace(TASK, visible_test_command=f"{loop}; echo ran-{orphans}")
    env_calls = [bash(f"{loop}; echo made-{orphans}"), bash(count), ToolCall("run_tests")]

    async def main() -> list[str]:
        env = Env(task, config)
        await env.reset()
        try:
            out = [(await env.step(c)).observation.content for c in env_calls]
            out.append((await env.step(bash(count))).observation.content)
            return out
        finally:
            await env.close()

    out = asyncio.run(main())
    for text in out:
        assert "Resource temporarily unavailable" not in text and "retry" not in text, text
    assert f"made-{orphans}" in out[0] and "[exit code 0]" in out[0]
    assert f"ran-{orphans}" in out[2] and "[exit code 0]" in out[2]
    # nothing left but the supervisor (and, in a bwrap sandbox, its init), bash, ls and grep
    assert int(out[1].splitlines()[0]) <= 5 and int(out[3].splitlines()[0]) <= 5


def test_commands_reach_the_shell_byte_for_byte(config: EnvConfig) -> None:
    # ASCII commands go to the shell as they are; others (here with backslash sequences that
    # printf %b would interpret) are escaped on the way and must arrive unchanged
    words = ["héllo wörld ✓", r"a\cb", r"\x41\n", "back\\\\slash\\", r"\0101 \u00e9"]
    quoted = " ".join("'" + w + "'" for w in words)
    out = run(
        config,
        [
            bash(f"printf '%s|' {quoted}; echo"),
            bash(r"printf '%s|' 'a\cb' '\x41'; echo"),
            bash(r"export KEEP='é\x41\\'; mkdir -p 'dïr'; cd 'dïr'"),
            bash("exit 3"),
            bash('printf "%s|%s\\n" "$KEEP" "$PWD"'),
        ],
    )
    assert out[0].splitlines()[0] == "|".join(words) + "|"
    assert out[1].splitlines()[0] == r"a\cb|\x41|"
    # the restarted shell gets the exported (non-ASCII) value and the directory back
    assert "a new one will start in /workspace/dïr" in out[3]
    assert out[4].splitlines()[0] == r"é\x41\\|/workspace/dïr"
