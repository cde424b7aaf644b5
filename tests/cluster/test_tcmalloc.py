"""Which tcmalloc `pagedserve serve` preloads into the Ray processes it starts
(cluster/tcmalloc.py); test_cli_serve.py checks that its engine replica maps it."""

from __future__ import annotations

from pagedserve.cluster import tcmalloc


def library_dir(tmp_path, name="libtcmalloc_minimal.so.4"):
    (tmp_path / name).write_bytes(b"")
    return (str(tmp_path / "missing"), str(tmp_path))


def test_found_tcmalloc_goes_first_in_ld_preload(tmp_path):
    environ = {"LD_PRELOAD": "/opt/libother.so"}
    path = tcmalloc.preload_for_children(environ, library_dir(tmp_path))
    assert path == str(tmp_path / "libtcmalloc_minimal.so.4")
    assert environ["LD_PRELOAD"] == f"{path}:/opt/libother.so"


def test_the_full_library_serves_too(tmp_path):
    environ: dict = {}
    assert tcmalloc.preload_for_children(environ, library_dir(tmp_path, "libtcmalloc.so.4")) == str(tmp_path / "libtcmalloc.so.4")
    assert environ == {"LD_PRELOAD": str(tmp_path / "libtcmalloc.so.4")}


def test_nothing_changes_without_it_or_when_switched_off(tmp_path):
    environ = {"LD_PRELOAD": "/opt/libother.so"}
    assert tcmalloc.preload_for_children(environ, (str(tmp_path),)) is None
    switched_off = {tcmalloc.SWITCH: "0"}
    assert tcmalloc.preload_for_children(switched_off, library_dir(tmp_path)) is None
    assert environ == {"LD_PRELOAD": "/opt/libother.so"} and switched_off == {tcmalloc.SWITCH: "0"}


def test_a_tcmalloc_already_preloaded_is_kept(tmp_path):
    environ = {"LD_PRELOAD": "/opt/libtcmalloc.so.4 /opt/libiomp5.so"}  # the loader also splits on spaces
    assert tcmalloc.preload_for_children(environ, library_dir(tmp_path)) == "/opt/libtcmalloc.so.4"
    assert environ["LD_PRELOAD"] == "/opt/libtcmalloc.so.4 /opt/libiomp5.so"
