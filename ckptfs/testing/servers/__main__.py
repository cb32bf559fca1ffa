"""``python -m ckptfs.testing.servers [name ...]``: start each available server (all of
`SERVERS` by default), write, list, reset, stop."""

import sys
import time

from ckptfs.testing.servers.registry import SERVERS, available

if __name__ == "__main__":
    # Smoke test: start each available server, write/list/reset, stop.
    names = sys.argv[1:] or list(SERVERS)
    failed = False
    for n in names:
        why = available(n)
        if why is not None:
            print(f"{n}: unavailable: {why}")
            continue
        t0 = time.monotonic()
        try:
            with SERVERS[n]() as srv:
                started = time.monotonic() - t0
                fs = srv.filesystem()
                fs.pipe_file(srv.url("smoke/a.bin"), b"hello")
                listed = fs.ls(srv.url("smoke"), detail=False)
                srv.reset()
                fs.invalidate_cache()
                after = fs.ls(srv.url(), detail=False)
                print(
                    f"{n}: started in {started:.2f} s at {srv.endpoint}; "
                    f"ls={listed}; after reset ls={after}"
                )
        except Exception as e:
            failed = True
            print(f"{n}: FAILED: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
