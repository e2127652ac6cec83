"""CURVE keys: `async-rl keys` writes key pairs and refuses to overwrite them."""
import subprocess
import sys


def test_keys_command_writes_key_pairs_and_refuses_to_overwrite(tmp_path):
    keys = tmp_path / "keys"
    cmd = [sys.executable, "-m", "async_rl.cli", "keys", str(keys)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    names = {p.relative_to(keys).as_posix() for p in keys.rglob("*") if p.is_file()}
    assert names == {"server.key", "server.key_secret", "client.key", "client.key_secret", "authorized/client.key"}
    assert (keys / "client.key_secret").stat().st_mode & 0o077 == 0  # secrets readable by the owner only
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exist" in again.stderr and len(again.stderr.splitlines()) == 1
