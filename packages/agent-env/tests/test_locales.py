"""The locale archive built for sandboxes: same locales as the host, working UTF-8."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

from tandem.agent_env import Env, EnvConfig, ToolCall, generate_tasks
from tandem.agent_env.sandbox.locales import LOCALE_DIR, build_locale_dir, covered_by


def _host_locales() -> list[str]:
    return sorted(p.name for p in Path(LOCALE_DIR).iterdir() if (p / "LC_CTYPE").is_file())


def test_archive_holds_the_hosts_locales(tmp_path: Path) -> None:
    built = build_locale_dir(tmp_path / "locale")
    has_archive = (Path(LOCALE_DIR) / "locale-archive").exists()
    if built is None:  # nothing to gain (an archive already) or no way to build one
        assert has_archive or not _host_locales() or shutil.which("localedef") is None
        return
    assert not has_archive
    assert (built / "locale-archive").is_file()
    assert sorted(p.name for p in built.iterdir() if p.is_dir()) == sorted(
        p.name for p in Path(LOCALE_DIR).iterdir() if p.is_dir()
    )
    # localedef lists the archive's locales: each host locale is in it (names normalised)
    listed = subprocess.run(
        ["localedef", f"--prefix={tmp_path}/x", "--list-archive", str(built / "locale-archive")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    norm = {n.lower().replace("-", "") for n in listed}
    assert all(name.lower().replace("-", "") in norm for name in _host_locales())


def test_a_host_with_an_archive_is_left_alone(tmp_path: Path) -> None:
    host = tmp_path / "host"
    (host / "C.utf8").mkdir(parents=True)
    (host / "C.utf8" / "LC_CTYPE").write_bytes(b"")
    (host / "locale-archive").write_bytes(b"")
    assert build_locale_dir(tmp_path / "out", str(host)) is None
    assert not (tmp_path / "out").exists()
    assert covered_by(("/usr",)) and not covered_by(("/opt", "/usr/lib/locale-other"))


def test_sandboxed_programs_get_a_working_utf8_locale(config: EnvConfig) -> None:
    async def main() -> tuple[str, bool]:
        env = Env(generate_tasks(7, 1)[0], config)
        await env.reset()
        try:
            cmd = "ls /usr/lib/locale; printf 'é✓x' | wc -m; printf 'é' | grep -c '^.$'"
            r = await env.step(ToolCall("bash", json.dumps({"command": cmd})))
            assert env._session is not None
            return r.observation.content, env._session.runtime.locale_dir is not None
        finally:
            await env.close()

    out, archived = asyncio.run(main())
    lines = out.splitlines()
    assert ("locale-archive" in lines) == archived
    assert set(_host_locales()) <= set(lines)
    assert "3" in lines and "1" in lines  # characters, not bytes: the UTF-8 locale is loaded
