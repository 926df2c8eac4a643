"""Security plumbing without a network: aiokafka client arguments (TLS, SASL PLAIN/SCRAM),
Redis arguments (ACL user/password, TLS), API-key hashing and checks, and redaction of secrets
wherever settings are shown. (The embedded broker has no SASL, so the Kafka side is proven on
the arguments handed to real aiokafka clients; Redis passwords are proven for real in
tests/transport/test_auth_redis.py.)"""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from services.gateway.auth import Authenticator, hash_key, parse_key_hashes
from services.gateway.responses import Rejected
from shared import settings as settings_mod
from shared import settings_doc
from shared.keys import RedisKeys
from shared.transport.bus import kafka_client_kwargs
from shared.transport.redis_conn import redis_kwargs
from tests import procs

SASL_PASSWORD = "sasl-Pa55-word-XYZ"
REDIS_PASSWORD = "redis-Pa55-word-QRS"
API_KEY = "sk-mmfleet-unit-0123456789"


def _settings(**kw) -> settings_mod.Settings:
    return settings_mod.from_env({}, **kw)


def test_plaintext_is_the_default():
    kw = kafka_client_kwargs(_settings(kafka_bootstrap="b:9092"))
    assert kw == {"bootstrap_servers": "b:9092", "security_protocol": "PLAINTEXT"}


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_sasl_ssl_arguments_reach_real_aiokafka_clients(mechanism):
    s = _settings(kafka_security_protocol="sasl_ssl", kafka_sasl_mechanism=mechanism.lower(),
                  kafka_sasl_username="svc", kafka_sasl_password=SASL_PASSWORD, kafka_ssl_check_hostname=False)
    kw = kafka_client_kwargs(s)
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == mechanism
    assert kw["sasl_plain_username"] == "svc" and kw["sasl_plain_password"] == SASL_PASSWORD
    assert isinstance(kw["ssl_context"], ssl.SSLContext) and kw["ssl_context"].check_hostname is False

    async def build():  # the clients accept them (constructing validates protocol / mechanism / context)
        producer = AIOKafkaProducer(**kw)
        assert producer.client._sasl_mechanism == mechanism
        assert producer.client._security_protocol == "SASL_SSL"
        consumer = AIOKafkaConsumer("t", **kw, group_id="g")
        assert consumer._client._sasl_plain_password == SASL_PASSWORD
        admin = AIOKafkaAdminClient(**kw)
        assert admin._client._ssl_context is kw["ssl_context"]

    asyncio.run(build())


def test_sasl_plaintext_has_no_ssl_context_and_ssl_has_no_sasl():
    kw = kafka_client_kwargs(_settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_mechanism="PLAIN",
                                       kafka_sasl_username="u", kafka_sasl_password=SASL_PASSWORD))
    assert "ssl_context" not in kw and kw["sasl_mechanism"] == "PLAIN"
    kw = kafka_client_kwargs(_settings(kafka_security_protocol="SSL"))
    assert "sasl_mechanism" not in kw and isinstance(kw["ssl_context"], ssl.SSLContext)


@pytest.mark.parametrize("kw, needle", [
    ({"kafka_security_protocol": "KERBEROS"}, "MMFLEET_KAFKA_SECURITY_PROTOCOL"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "GSSAPI"}, "MMFLEET_KAFKA_SASL_MECHANISM"),
    ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_mechanism": "PLAIN"}, "MMFLEET_KAFKA_SASL_USERNAME"),
])
def test_bad_kafka_security_settings_name_the_setting_not_the_secret(kw, needle):
    with pytest.raises(ValueError) as info:
        kafka_client_kwargs(_settings(kafka_sasl_password=SASL_PASSWORD, **kw))
    assert needle in str(info.value) and SASL_PASSWORD not in str(info.value)


def test_redis_arguments():
    assert redis_kwargs(_settings()) == {}
    kw = redis_kwargs(_settings(redis_username="app", redis_password=REDIS_PASSWORD))
    assert kw == {"username": "app", "password": REDIS_PASSWORD}
    kw = redis_kwargs(_settings(redis_url="rediss://r:6380/0", redis_ssl_cafile="/ca.pem",
                                redis_ssl_certfile="/c.pem", redis_ssl_keyfile="/k.pem"))
    assert kw == {"ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}
    with pytest.raises(ValueError, match="rediss://"):
        redis_kwargs(_settings(redis_ssl_cafile="/ca.pem"))


def test_settings_repr_and_redacted_hide_secrets():
    s = _settings(kafka_sasl_password=SASL_PASSWORD, redis_password=REDIS_PASSWORD,
                  redis_url=f"redis://app:{REDIS_PASSWORD}@r:6379/0")
    for text in (repr(s), str(s), f"{s}", str(settings_mod.redacted(s))):
        assert SASL_PASSWORD not in text and REDIS_PASSWORD not in text
        assert "***" in text
    assert settings_mod.redacted(s)["redis_url"] == "redis://app:***@r:6379/0"
    assert set(settings_doc.secret_values(s)) == {SASL_PASSWORD, REDIS_PASSWORD}
    assert settings_mod.redacted(_settings())["redis_password"] == ""  # unset stays visibly unset


def test_mmfleet_settings_prints_no_secret():
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(procs.REPO), "MMFLEET_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
           "MMFLEET_REDIS_PASSWORD": REDIS_PASSWORD, "REDIS_URL": f"redis://u:{REDIS_PASSWORD}@h:1/0",
           "MMFLEET_API_KEY_HASHES": hash_key(API_KEY)}
    out = subprocess.run([sys.executable, "-m", "services.cli", "settings"], env=env, capture_output=True,
                         text=True, check=True, cwd=procs.REPO)
    text = out.stdout + out.stderr
    assert "MMFLEET_KAFKA_SASL_PASSWORD" in text and "MMFLEET_REDIS_PASSWORD" in text
    assert SASL_PASSWORD not in text and REDIS_PASSWORD not in text and API_KEY not in text


def test_keys_hash_cli_prints_the_sha256():
    out = subprocess.run([sys.executable, "-m", "services.cli", "keys", "hash"], input=API_KEY + "\n",
                         capture_output=True, text=True, check=True, cwd=procs.REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(procs.REPO)})
    assert out.stdout.strip() == hash_key(API_KEY)
    assert len(out.stdout.strip()) == 64 and API_KEY not in out.stdout


def test_key_hash_entries():
    h = hash_key(API_KEY)
    assert parse_key_hashes((h, hash_key("other") + ":30"), 5) == {h: 5, hash_key("other"): 30}
    with pytest.raises(ValueError) as info:
        parse_key_hashes((API_KEY,), 0)  # a raw key pasted by mistake: refused, and not echoed
    assert API_KEY not in str(info.value) and "entry 0" in str(info.value)


def test_authenticator_identifies_or_refuses_with_401():
    open_auth = Authenticator(_settings(), redis=None, keys=RedisKeys("t"))
    assert open_auth.identify(None, via="http") is None  # no keys configured: the local demo
    auth = Authenticator(_settings(api_key_hashes=(hash_key(API_KEY),)), redis=None, keys=RedisKeys("t"))
    assert auth.identify(f"Bearer {API_KEY}", via="http") == hash_key(API_KEY)[:12]
    for header, code in ((None, "missing_api_key"), ("", "missing_api_key"), (API_KEY, "missing_api_key"),
                         ("Bearer ", "missing_api_key"), (f"Bearer {API_KEY}x", "invalid_api_key")):
        with pytest.raises(Rejected) as info:
            auth.identify(header, via="kafka")
        ev = info.value.event
        assert (ev.status, ev.type, ev.code) == (401, "authentication_error", code)
        assert API_KEY not in ev.message


def test_benchmark_reports_record_settings_without_secrets():
    from loadtest.targets import Targets

    shown = Targets._settings_of({"MMFLEET_REDIS_PASSWORD": REDIS_PASSWORD,
                                  "MMFLEET_KAFKA_SASL_PASSWORD": SASL_PASSWORD,
                                  "REDIS_URL": f"redis://u:{REDIS_PASSWORD}@h:1/0", "MMFLEET_POOL_BYTES": "1"})
    assert SASL_PASSWORD not in str(shown) and REDIS_PASSWORD not in str(shown)
    assert shown["MMFLEET_POOL_BYTES"] == "1" and shown["MMFLEET_REDIS_PASSWORD"] == "***"
