"""The fetch rules on their own (gateway/generate/media.py): which addresses are never fetched,
redirect and size limits, local files only under their directory."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, TooLarge
from gateway.generate.media import MediaRules, check_address, load_image
from tests.vision.models import image_bytes


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "192.168.0.1", "172.16.0.1", "169.254.169.254", "::1", "fe80::1", "::ffff:127.0.0.1", "0.0.0.0", "fd00::1"],
)  # fmt: skip
def test_addresses_that_are_not_public_are_refused(address):
    with pytest.raises(InvalidRequest, match="not a public address"):
        check_address(address, MediaRules(), "host", "p")
    check_address("93.184.215.14", MediaRules(), "host", "p")  # a public one passes


def test_limits_on_a_host_the_rules_allow(image_host):
    rules = MediaRules(max_bytes=4096, allow_private=True)
    assert load_image(f"{image_host}/ok.png", MediaRules(allow_private=True), "p").size == (40, 48)
    with pytest.raises(InvalidRequest, match="more than 3 redirects"):
        load_image(f"{image_host}/loop", rules, "p")
    for path in ("/big", "/nolength"):  # declared, or found while reading
        with pytest.raises(TooLarge):
            load_image(image_host + path, rules, "p")
    with pytest.raises(InvalidRequest, match="not among the allowed media domains"):
        load_image(f"{image_host}/ok.png", MediaRules(allow_private=True, allowed_domains=("example.com",)), "p")


def test_local_files_only_under_their_directory(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes(1))
    rules = MediaRules(local_root=str(tmp_path / "."))
    assert load_image(f"file://{tmp_path}/a.png", rules, "p").size == (40, 48)
    with pytest.raises(InvalidRequest, match="no file under"):
        load_image(f"file://{tmp_path}/../{tmp_path.name}/../a.png", rules, "p")
    with pytest.raises(InvalidRequest, match="scheme 'ftp'"):
        load_image("ftp://example.com/a.png", rules, "p")
