"""The config tree (daemon/config.py, daemon/config_tree.py): every key has a flag, an environment
variable and help; file < environment < flag; anything wrong names the key, the value and its source."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from daemon import cli, config, config_tree
from daemon.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
KEYS = config_tree.keys(config.Config)


def parse(*argv: str, env: dict[str, str] | None = None) -> config.Config:
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.build(p.parse_args(list(argv)), env or {})


def test_every_key_has_a_flag_an_env_var_and_help():
    p = argparse.ArgumentParser()
    config.add_flags(p)
    flags = {o for a in p._actions for o in a.option_strings}
    assert len(KEYS) > 100
    for k in KEYS:
        assert k.flag in flags, k.dotted
        assert k.help and "\n" not in k.help, k.dotted
        assert k.env == "SDCWATCH_" + k.dotted.replace(".", "_").upper()
    assert len({k.flag for k in KEYS}) == len(KEYS) and len({k.env for k in KEYS}) == len(KEYS)
    assert config.flag_name("tiers", "nvme", "dir") == "--tiers-nvme-dir"
    assert config.flag_name("agent", "listen") == "--listen"
    assert {"checkpoints.memory_cap_bytes", "checkpoints.verify_on_commit", "loss.spike_ratio",
            "rollback.skip_batches", "tiers.nvme.dir", "tiers.s3.url"} <= {k.dotted for k in KEYS}


def test_run_help_has_a_line_for_every_flag_grouped_by_section(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for title in ("[agent]", "[loss]", "[rollback]", "[checkpoints]", "[tiers]", "[tiers.nvme]", "[tiers.s3]"):
        assert f"\n{title}" in out, title
    assert re.search(r"--tiers-nvme-keep N\s+newest checkpoints kept on the tier \(default 3\)", out)
    assert re.search(r"--checkpoints-verify-on-commit, --no-checkpoints-verify-on-commit\s+re-read", out)


def test_flags_override_and_coerce(tmp_path):
    cfg = parse("--state-dir", str(tmp_path), "--nvml-poll-interval-s", "2.5", "--no-nvml-enabled",
                "--journal-keep-files", "3", "--rollback-kinds", "nonfinite,divergence")
    assert cfg.nvml.poll_interval_s == 2.5 and cfg.nvml.enabled is False and cfg.journal.keep_files == 3
    assert cfg.agent.socket == str(tmp_path / "agent.sock")
    assert cfg.rollback.kinds == frozenset({"nonfinite", "divergence"})


def test_file_then_env_then_flag(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[checkpoints]\nkeep_committed = 4\nmemory_cap_bytes = 1000\n"
                    "[tiers]\ninterval_s = 3.0\n[tiers.nvme]\nkeep = 5\ndir = 'off'\n"
                    "[tiers.s3]\nurl = 's3://b/p'\n[loss]\nwindow = 64\n[rollback]\nkinds = ['nonfinite']\n")
    env = {"SDCWATCH_CHECKPOINTS_KEEP_COMMITTED": "6", "SDCWATCH_TIERS_NVME_KEEP": "7",
           "SDCWATCH_LOSS_WINDOW": "32", "SDCWATCH_AGENT_HOSTNAME": "node-x"}
    cfg = parse("--config", str(path), "--tiers-nvme-keep", "8", env=env)
    assert cfg.checkpoints.keep_committed == 6 and cfg.checkpoints.memory_cap_bytes == 1000   # env > file
    assert cfg.tiers.nvme.keep == 8 and cfg.tiers.nvme.dir == "off"                           # flag > env
    assert cfg.tiers.interval_s == 3.0 and cfg.tiers.s3.url == "s3://b/p"
    assert cfg.tiers.flash.every_n == 5 and cfg.tiers.s3.every_s == 1800.0    # each tier's own defaults
    assert cfg.loss.window == 32 and cfg.agent.hostname == "node-x"
    assert cfg.rollback.kinds == frozenset({"nonfinite"})


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
    (["--checkpoints-keep-committed", "0"], "checkpoints.keep_committed"),
    (["--checkpoints-memory-cap-bytes", "-1"], "checkpoints.memory_cap_bytes"),
    (["--loss-spike-ratio", "0.5"], "loss.spike_ratio"),
    (["--loss-min-samples", "500"], "loss.min_samples"),
    (["--rollback-skip-batches", "-3"], "rollback.skip_batches"),
    (["--rollback-kinds", "spike"], "rollback.kinds"),
    (["--tiers-nvme-keep", "0"], "tiers.nvme.keep"),
    (["--tiers-s3-url", "http://x"], "tiers.s3.url"),
    (["--tiers-s3-part-mib", "1"], "tiers.s3.part_mib"),
    (["--tiers-nvme-dir", "/a", "--tiers-flash-dir", "/a"], "tiers.flash.dir"),
])
def test_bad_values_name_the_key_and_the_source(argv, key):
    with pytest.raises(ConfigError) as err:
        parse(*argv)
    assert err.value.key == key
    assert f"from {argv[-2]}" in err.value.why      # the flag that set it


@pytest.mark.parametrize("toml,key,needle", [
    ("[tiers]\nnvme_dir = '/x'\n", "tiers.nvme_dir", "moved to [tiers.nvme] dir (flag --tiers-nvme-dir"),
    ("[tiers]\ns3_every_s = 60\n", "tiers.s3_every_s", "moved to [tiers.s3] every_s"),
    ("[tiers.nvme]\nkeepp = 1\n", "tiers.nvme.keepp", "did you mean 'keep'?"),
    ("[tiers]\nnvme = 1\n", "tiers.nvme", "is a table"),
    ("[checkpoints]\nverify_on_commit = 'yes please'\n", "checkpoints.verify_on_commit", "expected true or false"),
    ("[loss]\nwindow = 1.5\n", "loss.window", "expected an integer, got 1.5 in"),
    ("[rollback]\nkinds = [1]\n", "rollback.kinds", "expected a list of names"),
    ("[loss]\nspike_z = -1.0\n", "loss.spike_z", "must be a finite number >= 0, got -1.0 (in"),
    ("[lose]\nwindow = 3\n", "lose", "did you mean 'loss'?"),
])
def test_file_errors_name_the_key_value_and_fix(tmp_path, toml, key, needle):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        parse("--config", str(path))
    assert err.value.key == key and needle in err.value.why and str(path) in err.value.why, str(err.value)


@pytest.mark.parametrize("env,key,needle", [
    ({"SDCWATCH_TIERS_NVME_KEEP": "three"}, "tiers.nvme.keep", "got 'three' from $SDCWATCH_TIERS_NVME_KEEP"),
    ({"SDCWATCH_LOSS_WINDOWW": "3"}, "SDCWATCH_LOSS_WINDOWW", "did you mean 'SDCWATCH_LOSS_WINDOW'?"),
    ({"SDCWATCH_CHECKPOINTS_PENDING_TIMEOUT_S": "0"}, "checkpoints.pending_timeout_s", "from $SDCWATCH_"),
])
def test_env_errors_name_the_variable(env, key, needle):
    with pytest.raises(ConfigError) as err:
        parse(env=env)
    assert err.value.key == key and needle in err.value.why, str(err.value)


def test_process_switches_are_not_settings(tmp_path):
    cfg = parse("--state-dir", str(tmp_path), env={"SDCWATCH_NVML_TIMING": "1", "SDCWATCH_SOCKET": "/x.sock",
                                                   "SDCWATCH_PEER_INSECURE": "1"})
    assert cfg.nvml.enabled
    # every SDCWATCH_ name the code reads under a config section's prefix is a setting or a listed switch
    prefixes = tuple("SDCWATCH_" + t.dotted.replace(".", "_").upper() + "_"
                     for t in config_tree.tables(config.Config))
    settings = {k.env for k in KEYS}
    used = set()
    for pkg in ("daemon", "probes", "checkpoint", "checksums", "sdcwatch"):
        for path in (ROOT / pkg).rglob("*.py"):
            used |= set(re.findall(r"[\"'](SDCWATCH_[A-Z0-9_]+)[\"']", path.read_text()))
    clash = {n for n in used if n.startswith(prefixes)} - settings - config_tree.PROCESS_SWITCHES
    assert clash == set()


def test_cli_exits_2_with_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SDCWATCH_TIERS_S3_VERIFY", "maybe")
    assert cli.main(["run", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sdcwatch: config error: tiers.s3.verify: expected store or readback, got 'maybe' "
                          "(from $SDCWATCH_TIERS_S3_VERIFY)") and "Traceback" not in err


def test_hostport():
    assert config.parse_hostport("k", "[::1]:80") == ("[::1]", 80)
    assert config.parse_hostport("k", ":9464") == ("0.0.0.0", 9464)
    with pytest.raises(ConfigError):
        config.parse_hostport("k", "host")


def test_docs_config_md_lists_every_key():
    """docs/config.md is generated from the tree: `python scripts/gen_config_doc.py` when this fails."""
    text = (ROOT / "docs" / "config.md").read_text()
    assert text == config_tree.markdown(config.Config, config.DOC_INTRO)
    for k in KEYS:
        assert f"`{k.flag}`" in text and f"`{k.env}`" in text
