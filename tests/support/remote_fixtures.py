"""The engine-level remote tests' server fixture (Redis and Valkey on loopback) and its credentials."""

import pytest
from redis_servers import KINDS, RedisServer, require

PW = "team-pw-61d2-SECRET"
SECRET = "team-mac-secret-SECRET"
READER, READER_PW = "reader-2c4", "reader-pw-5e1-SECRET"


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    require(request.param)
    return request.param


@pytest.fixture
def server(kind, tmp_path):
    s = RedisServer(tmp_path / "redis", password=PW, kind=kind,
                    users=(f"{READER} on >{READER_PW} ~* &* -@all +@read +@connection",)).start()
    yield s
    s.stop()
