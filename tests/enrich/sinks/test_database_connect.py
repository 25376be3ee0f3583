"""The database output's connections take the URL's parameters as the refresher does for the same
URL (TLS, timeouts, an init_command), on the local MariaDB; a parameter PyMySQL does not take is
refused, naming it."""

from __future__ import annotations

import pytest

from enrich.sinks.database.connect import connect, mysql_args
from refstream.errors import ConfigError, TransientError

pytestmark = pytest.mark.integration


def test_the_urls_parameters_reach_the_connection(mysql_url: str) -> None:
    conn = connect(mysql_url + "&init_command=SET%20%40refstream_probe%20%3D%207&read_timeout=9", "mysql", timeout=2)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @refstream_probe, @@session.time_zone, @@session.max_statement_time")
            assert cur.fetchone() == (7, "+00:00", 2.0)   # the URL's init_command, then the job's session
        assert conn._read_timeout == 9 and conn._write_timeout == 7   # the URL's, else the job's
    finally:
        conn.close()


def test_tls_asked_for_in_the_url_is_required(mysql_url: str) -> None:
    """The local server has TLS off: a URL that asks for it (ssl_ca) gets no plain connection."""
    with pytest.raises(TransientError, match="SSL is required"):
        connect(mysql_url + "&ssl_ca=/etc/ssl/certs/ca-certificates.crt", "mysql")
    assert mysql_args(mysql_url + "&ssl_ca=/ca.pem&ssl_check_hostname=false", 5)["ssl"] == \
        {"ca": "/ca.pem", "check_hostname": False}


def test_an_unknown_url_parameter_is_refused_naming_it(mysql_url: str) -> None:
    with pytest.raises(ConfigError, match=r"output\.database\.url: unknown parameter\(s\) \['sslca'\]"):
        connect(mysql_url + "&sslca=/ca.pem", "mysql")
