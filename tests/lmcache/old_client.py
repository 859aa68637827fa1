"""An LMCache 0.5.0 client (its own MessageQueueClient, run with that
release's package first on PYTHONPATH): get_chunk_size, then noop.  Prints
one line per call: its result or the exception.  0.5.0 numbered its
operations in enum order (get_chunk_size was #18, noop #21), before 0.5.5
froze the table 0.5.6 speaks."""
import os
import sys

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import lmcache  # noqa: E402
import zmq  # noqa: E402
from lmcache.v1.multiprocess.mq import MessageQueueClient  # noqa: E402
from lmcache.v1.multiprocess.protocol import RequestType, get_response_class  # noqa: E402

print("lmcache from", os.path.dirname(lmcache.__file__), flush=True)
c = MessageQueueClient(sys.argv[1], zmq.Context.instance())
for rt in (RequestType.GET_CHUNK_SIZE, RequestType.NOOP):
    f = c.submit_request(rt, [], get_response_class(rt))
    try:
        print(rt.name, "->", repr(f.result(timeout=float(sys.argv[2]))), flush=True)
    except BaseException as e:  # noqa: BLE001
        print(rt.name, "raised", type(e).__name__, flush=True)
os._exit(0)
