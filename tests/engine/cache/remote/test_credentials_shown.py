"""Credentials are never shown (issue 30): user info, query and fragment of every URL, and the
team secret, server password and signing key, in every place a notebook shows or saves text:
%config (the kernel's settings), %cache config (its summary), %env, reprs, error messages,
%xmode Verbose tracebacks (IPython's own formatter, with every frame's variables) and DEBUG logs.
No server is needed: the URLs point at a closed loopback port or are refused before connecting.
"""

from __future__ import annotations

import logging
import sys

import pytest
from IPython.core.ultratb import VerboseTB

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.remote import RemoteTier, parse_remote_url, redact, resolve
from mlxcache_kernel.engine.cache.remote.writers import SigningKey
from mlxcache_kernel.engine.config import EngineConfig, RemoteConfigError, Secret

PW, TEAM, SIGN = "pw-hunter2-Q", "team-secret-hunter2-Q", SigningKey.generate().seed_text()
URLS = {"userinfo": f"redis://carol-hunter2:{PW}@127.0.0.1:1/0",
        "query": f"redis://127.0.0.1:1/0?password={PW}",
        "fragment": f"redis://127.0.0.1:1/0#{PW}",
        "all three": f"rediss://u:{PW}@127.0.0.1:1?password={PW}#{PW}"}
NEVER = (PW, "hunter2", TEAM, SIGN)


def clean(*texts) -> None:
    for t in texts:
        for s in NEVER:
            assert s not in str(t), f"{s!r} shown in {str(t)[:300]!r}"


@pytest.mark.parametrize("url", URLS.values(), ids=URLS.keys())
def test_redact_hides_user_info_query_and_fragment(url):
    shown = redact(url)
    clean(shown)
    assert "127.0.0.1:1" in shown and shown.startswith(url.split("://")[0] + "://")


@pytest.mark.parametrize("url", [URLS["query"], URLS["fragment"], URLS["all three"]], ids=["query", "fragment", "all"])
def test_a_refused_url_is_a_clear_error_and_its_traceback_holds_no_credential(url, tmp_path):
    with pytest.raises(RemoteConfigError) as err:
        parse_remote_url(url)
    clean(str(err.value))
    assert "invalid remote URL" in str(err.value)
    try:
        Engine(cache_dir=tmp_path / "x", remote_url=url, remote_secret=TEAM, remote_password=PW,
               remote_signing_key=SIGN)
    except RemoteConfigError:
        etype, value, tb = sys.exc_info()
    else:
        raise AssertionError("accepted")
    while tb.tb_frame.f_code.co_name != "__init__":  # from Engine.__init__ down (the caller's frame is the user's)
        tb = tb.tb_next
    clean(str(value), "\n".join(VerboseTB(theme_name="nocolor").structured_traceback(etype, value, tb)))
    assert not (tmp_path / "x").exists()


def test_a_failed_engine_start_shows_no_secret_in_any_frame(tmp_path):
    """A too-short team secret fails deep inside the tier: every frame from Engine.__init__ down is clean."""
    try:
        Engine(cache_dir=tmp_path / "x", remote_url=URLS["userinfo"], remote_secret="short-hunter2",
               remote_password=PW, remote_signing_key=SIGN)
    except ValueError:
        etype, value, tb = sys.exc_info()
    while tb.tb_frame.f_code.co_name != "__init__":
        tb = tb.tb_next
    text = "\n".join(VerboseTB(theme_name="nocolor").structured_traceback(etype, value, tb))
    assert "16 bytes" in text and "Secret(***)" in text  # the frames show the wrapper
    clean(text)


def test_reprs_stats_and_debug_logs_of_a_running_engine_hold_no_credential(tmp_path, tiny_model_dir, caplog):
    caplog.set_level(logging.DEBUG)
    url = URLS["userinfo"]  # a closed port: every remote call fails, and says so
    config = EngineConfig(remote_url=url, remote_secret=TEAM, remote_password=PW, remote_signing_key=SIGN)
    settings = resolve(url, secret=TEAM, password=PW, signing_key=SIGN, env={})
    texts = [repr(config), str(config.remote_url.__repr__()), repr(config.remote_secret), repr(settings),
             repr(settings.signing_key), repr(Secret(TEAM)), str(Secret(PW))]
    with RemoteTier(url, secret=TEAM, password=PW, signing_key=SIGN) as tier:
        texts += [repr(tier), tier.url, str(tier.stats())]
    with Engine(cache_dir=tmp_path / "e", remote_url=url, remote_secret=TEAM, remote_password=PW,
                remote_signing_key=SIGN) as eng:
        eng.load_model(tiny_model_dir, name="m")
        for i in range(3):  # three failed lookups open the breaker, which logs
            r = eng.generate_tokens(list(range(3 + i, 303 + i)), max_tokens=2, model="m")
        texts += [repr(eng.config), str(eng.stats()), str(r.stats), str(eng.flush())]
        assert eng.stats()["remote_errors"] >= 1  # it did try, and failed, and logged
    texts.append(caplog.text)
    assert "breaker" in caplog.text
    clean(*texts)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(Secret(TEAM))


@pytest.mark.parametrize("url", URLS.values(), ids=URLS.keys())
def test_kernel_settings_config_summary_and_env_hold_no_credential(url, monkeypatch):
    from mlxcache_kernel.settings import MLXCache, shown_env

    monkeypatch.setenv("MLXCACHE_REMOTE_URL", url)
    monkeypatch.setenv("MLXCACHE_REMOTE_SECRET", TEAM)
    monkeypatch.setenv("MLXCACHE_REMOTE_SIGNING_KEY", SIGN)
    s = MLXCache()
    texts = [s.remote_url, str(s.summary()), MLXCache.class_get_help(s), repr(s)]  # %config, %cache config
    texts += [shown_env(k, v) for k, v in (("MLXCACHE_REMOTE_URL", url), ("MLXCACHE_REMOTE_SECRET", TEAM),
                                          ("MLXCACHE_REMOTE_SIGNING_KEY", SIGN))]  # %env
    typed = MLXCache()
    typed.remote_url = url.replace("carol-hunter2:", "")  # typed into a cell (a password warns)
    texts += [typed.remote_url, str(typed.summary())]
    clean(*texts)
    kw = s.engine_kwargs()  # what the engine gets: the URL whole (a query or fragment is then refused)
    assert str.__str__(kw["remote_url"]) == url and kw["remote_secret"] == TEAM
    clean(repr(kw))


def test_a_password_sent_in_clear_to_another_host_warns(recwarn):
    with pytest.warns(UserWarning, match="travels in clear") as w:
        resolve(f"redis://u:{PW}@cache.example:6379", secret=TEAM, env={})
    clean(*(str(x.message) for x in w))
    with pytest.warns(UserWarning, match="travels in clear"):
        resolve("redis://10.1.2.3:6379", secret=TEAM, password=PW, env={})
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve(f"redis://u:{PW}@127.0.0.1:6379", secret=TEAM, env={})  # loopback: no warning
        resolve(f"rediss://u:{PW}@cache.example:6380", secret=TEAM, env={})  # TLS
        resolve("redis://cache.example:6379", secret=TEAM, env={})  # no password
