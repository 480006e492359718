from __future__ import annotations

import argparse

import pytest

from daemon import config
from daemon.errors import ConfigError


def parse(*argv: str) -> config.Config:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.build(p.parse_args(list(argv)))


def test_every_key_has_a_flag():
    p = argparse.ArgumentParser()
    config.add_flags(p)
    flags = {a.option_strings[0] for a in p._actions if a.option_strings}
    import dataclasses

    for f in dataclasses.fields(config.Config):
        for k in dataclasses.fields(getattr(config.Config(), f.name)):
            assert config.flag_name(f.name, k.name) in flags


def test_flags_override_and_coerce(tmp_path):
    cfg = parse("--state-dir", str(tmp_path), "--nvml-poll-interval-s", "2.5", "--no-nvml-enabled",
                "--journal-keep-files", "3")
    assert cfg.nvml.poll_interval_s == 2.5 and cfg.nvml.enabled is False and cfg.journal.keep_files == 3
    assert cfg.agent.socket == str(tmp_path / "agent.sock")


@pytest.mark.parametrize("argv,key", [
    (["--journal-keep-files", "many"], "journal.keep_files"),
    (["--journal-max-bytes", "10"], "journal.max_bytes"),
    (["--metrics-listen", "1.2.3.4:99999"], "agent.metrics_listen"),
    (["--tls-cert", "/nonexistent.pem"], "agent.tls_cert"),
    (["--socket", "/tmp/" + "x" * 200], "agent.socket"),
    (["--socket-mode", "rw"], "agent.socket_mode"),
    (["--event-loop", "trio"], "agent.event_loop"),
    (["--nvml-rotate-per-poll", "0"], "nvml.rotate_per_poll"),
    (["--nvml-sweep-s", "0"], "nvml.sweep_s"),
    (["--nvml-skip-fields", "../etc"], "nvml.skip_fields"),
])
def test_bad_values_name_the_key(argv, key):
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert err.value.key == key


def test_hostport():
    assert config.parse_hostport("k", "[::1]:80") == ("[::1]", 80)
    assert config.parse_hostport("k", ":9464") == ("0.0.0.0", 9464)
    with pytest.raises(ConfigError):
        config.parse_hostport("k", "host")
