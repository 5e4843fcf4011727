"""The one redactor: secret keys (and run.secret_keys), URL passwords and credential values from
the environment, in configs, text and command lines; the W&B command line; `fw config`."""

from __future__ import annotations

import json
import sys

import pytest

from framework import secrets
from framework.loggers.wandb.logger import redacted_argv

PASSWORD = "pw-7f3a9c1e"
TOKEN = "hf_5e2b8d41c0"


def test_a_url_password_is_replaced_under_any_key():
    cfg = {"callbacks": {"pruning": {"storage": f"postgresql://fw:{PASSWORD}@db:5432/optuna"}}}
    out = secrets.redact(cfg, values=())
    assert out["callbacks"]["pruning"]["storage"] == "postgresql://fw:***@db:5432/optuna"
    # a port and a path are not a password; a user with no password has nothing to hide
    for text in ("http://host:8080/a@b", "s3://bucket@host/x", "no url here"):
        assert secrets.redact_text(text, ()) == text
    assert PASSWORD in secrets.secret_values(cfg), "scrubbed elsewhere too (a log line)"


def test_a_credential_from_the_environment_is_scrubbed_wherever_it_appears(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("OPENAI_KEY", "sk-0123456789")
    cfg = {"extra": {"note": TOKEN, "cmd": f"login --with {TOKEN}", "key": "sk-0123456789"}}
    out = secrets.redact(cfg)
    assert out == {"extra": {"note": "***", "cmd": "login --with ***", "key": "***"}}
    assert secrets.redact_text(f"[fw] got {TOKEN}") == "[fw] got ***"


def test_values_handed_to_the_workers_are_credentials_there(monkeypatch):
    """The worker restores the secret values config.yaml leaves out (ENV): the meta.json and
    W&B config it derives from them are scrubbed of them too."""
    handed = {"extra.note": "the-value-42", "callbacks.pruning.storage": f"mysql://u:{PASSWORD}@h"}
    monkeypatch.setenv(secrets.ENV, json.dumps(handed))
    found = secrets.environment_credentials()
    assert {"the-value-42", PASSWORD} <= found
    assert json.dumps(handed) not in found


def test_command_lines_hide_secret_keys_urls_and_values(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    words = ["+extra.api_token=S", "+extra.note=" + TOKEN, "+extra.pin=1234", "lr=0.1"]
    words += [f"--storage=postgresql://u:{PASSWORD}@h/d"]
    shown = secrets.redact_words(words, secrets.key_pattern(["pin"]))
    assert shown == [
        "+extra.api_token=***",
        "+extra.note=***",
        "+extra.pin=***",
        "lr=0.1",
        "--storage=postgresql://u:***@h/d",
    ]


def test_the_wandb_command_line_knows_run_secret_keys(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["fw", "train", "+extra.pin=12345678", "+extra.x=value-99"])
    with redacted_argv(secrets.key_pattern(["pin"]), {"value-99"}):
        assert sys.argv == ["fw", "train", "+extra.pin=***", "+extra.x=***"]
    assert sys.argv[2] == "+extra.pin=12345678", "restored"


def test_fw_config_prints_no_secret(monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    args = ["+extra.api_token=S3cr3t", f"+extra.note={TOKEN}", "+extra.t=${oc.env:HF_TOKEN}"]
    assert main(["config", *args]) == 0
    out = capsys.readouterr().out
    assert "S3cr3t" not in out and TOKEN not in out
    assert "api_token: '***'" in out and "t: ${oc.env:HF_TOKEN}" in out


def test_a_slurm_submission_script_is_left_without_secrets(tmp_path, monkeypatch):
    from framework.launchers.slurm import redact_scripts

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    script = tmp_path / "123_submission.sh"
    script.write_text(f"#!/bin/bash\nexport HF_TOKEN={TOKEN}\nexport DB=mysql://u:{PASSWORD}@h\n")
    redact_scripts(tmp_path)
    text = script.read_text()
    assert TOKEN not in text and PASSWORD not in text and "export HF_TOKEN=***" in text


def test_a_tokenizer_key_is_not_a_secret_but_a_token_key_is():
    """`task.data.tokenizer=DIR` is a path the workers must read as written; `hf_token` is not."""
    from framework.secrets import is_secret_key

    assert not is_secret_key("tokenizer") and not is_secret_key("tokenise")
    assert is_secret_key("hf_token") and is_secret_key("TOKEN") and is_secret_key("auth_tokens")


def test_a_count_of_tokens_is_shown_and_a_token_is_not(monkeypatch):
    """`fw plan --tokens 1e12` and `tokens=` are numbers a user must see in a command line or an
    error; `token=`, `hf_token` and a `WANDB_API_TOKEN`-like variable stay hidden."""
    from framework.errors import ConfigError
    from framework.secrets import is_secret_key

    assert not any(map(is_secret_key, ["--tokens", "tokens", "max_tokens", "pad_token_id"]))
    assert all(map(is_secret_key, ["token", "hf_token", "WANDB_API_TOKEN", "access_tokens"]))
    words = ["tokens=1e12", "token=abc", "+extra.hf_token=xyz", "task.data.max_tokens=4096"]
    shown = secrets.redact_words(words, values=())
    assert shown == ["tokens=1e12", "token=***", "+extra.hf_token=***", words[3]]
    assert "--tokens=-5e9: must be" in str(ConfigError("--tokens", "-5e9", "must be above 0"))
    assert "hf_token=***: " in str(ConfigError("hf_token", "hf_abcdef", "is wrong"))
    env = {"WANDB_API_TOKEN": "wb-12345678", "MAX_TOKENS": "409600", "FW_TOKENS": "1000000"}
    assert secrets.environment_credentials(env) == {"wb-12345678"}


def test_more_credential_words_and_any_key_ending_in_key():
    from framework.secrets import is_secret_key

    for key in ("passphrase", "authorization", "signing_key", "ssh-key", "db_pwd", "auth"):
        assert is_secret_key(key), key
    for key in ("oauth", "basic_auth", "session_cookie", "PASSPHRASE"):
        assert is_secret_key(key), key
    for key in ("author", "authority", "tensor_keys", "monkey", "keyboard", "sort_keys"):
        assert not is_secret_key(key), key
    env = {"PWD": "/home/me/project", "OLDPWD": "/home/me", "DB_PWD": "pw-12345678"}
    assert secrets.environment_credentials(env) == {"pw-12345678"}, "the shell's PWD is no secret"


def test_a_short_value_under_a_secret_key_is_scrubbed_as_a_word():
    """Six characters or more are scrubbed wherever they appear; a shorter value under a secret
    key only where it stands alone (not inside a longer word or number), and a true/false or a
    short number under such a key (use_auth_token, auth_timeout) is a setting, not a secret."""
    cfg = {"extra": {"signing_key": "k9Q", "passphrase": "open", "use_auth_token": True}}
    cfg["extra"]["auth_timeout"] = 30
    assert secrets.redact(cfg, values=())["extra"] == {
        "signing_key": "***",
        "passphrase": "***",
        "use_auth_token": True,
        "auth_timeout": "***",
    }
    found = secrets.values_under_secret_keys(cfg)
    assert found == {"k9Q", "open"}
    text = "login k9Q failed (k9Qx kept), 'open' refused at step 30; reopen"
    assert secrets.redact_text(text, found) == (
        "login *** failed (k9Qx kept), '***' refused at step 30; reopen"
    )


BAD_OVERRIDES = {
    # a token the override parser refuses: the parser's error quotes the override
    "unparsable value": (["launcher.rdzv_token=Zm9vYmFy/c2VjcmV0+=="], "Zm9vYmFy/c2VjcmV0"),
    # Hydra's error for a key given twice: the whole command line is echoed
    "key given twice": (["+extra.api_token=dup-7c1e9b", "+extra.api_token=dup-7c1e9b"], "dup-"),
    # OmegaConf's message quotes the list it cannot convert
    "list under a secret key": (["launcher.rdzv_token=[lst-4b7d2e,lst-9a3f1c]"], "lst-"),
    "short value": (["+extra.db_pwd=Zq4", "+extra.db_pwd=Zq4"], "Zq4"),
    "short list elements": (["launcher.rdzv_token=[Zq4,Wx5]"], "Zq4"),
}


@pytest.mark.parametrize(("args", "secret"), list(BAD_OVERRIDES.values()), ids=list(BAD_OVERRIDES))
def test_an_error_about_a_secret_override_does_not_repeat_it(
    args, secret, workdir, monkeypatch, capsys
):
    from tests.conftest import QUIET, refused

    err = refused([*args, *QUIET], workdir, monkeypatch, capsys)
    assert secret not in err and "***" in err, err


def test_a_search_over_a_secret_key_is_refused_before_anything_is_written(
    workdir, monkeypatch, capsys
):
    """Optuna keeps each sampled value and the choices in its storage, in clear: a search over
    a secret is refused (exit 2), nothing is written, and the values are not echoed."""
    from framework.cli import main

    monkeypatch.chdir(workdir)
    args = ["sweep", "+extra.api_token=choice(tok-5e1a9c,tok-3b8d7f)", "--trials", "1"]
    assert main([*args, "trainer.max_steps=1", "run.dir=search"]) == 2
    err = capsys.readouterr().err
    assert "+extra.api_token=***: a search over a secret" in err, err
    assert "tok-" not in err and not (workdir / "search").exists()


def test_run_secret_keys_is_written_as_the_names_it_holds():
    """`run.secret_keys` names keys, it holds no secret: written as it is (a '***' in its place
    left a process reading config.yaml with a pattern that does not compile), while the keys it
    names are redacted."""
    cfg = {"run": {"secret_keys": ["signing_.*"]}, "extra": {"signing_salt": "s3cr3t-salt"}}
    pattern = secrets.key_pattern(cfg["run"]["secret_keys"])
    written = secrets.redact(cfg, pattern, values=[])
    assert written["run"]["secret_keys"] == ["signing_.*"]
    assert written["extra"]["signing_salt"] == secrets.REDACTED
    assert secrets.key_pattern(written["run"]["secret_keys"]).search("signing_salt")
