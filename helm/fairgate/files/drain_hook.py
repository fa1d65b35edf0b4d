# The vLLM pods' lifecycle hooks (python3 of the vLLM image, standard library only).
# drain: ask the gateway to drain this pod's backend and move its running streams after
# FAIRGATE_DRAIN_GRACE_S, then wait that long plus FAIRGATE_DRAIN_MARGIN_S so vLLM still
# serves them until they moved. undrain: dispatch to it again (the pod started).
# A gateway that cannot be reached is reported and never blocks the pod: its streams then
# fail over mid-answer instead.
import json
import os
import sys
import time
import urllib.request

action = sys.argv[-1]
key = os.environ.get("DRAIN_ADMIN_KEY", "")
backend = "%s-%s" % (os.environ["FAIRGATE_POOL"], os.environ["POD_NAME"].rsplit("-", 1)[1])
grace = float(os.environ.get("FAIRGATE_DRAIN_GRACE_S", "0"))
body = {"migrate": True, "grace_s": grace} if action == "drain" else None
request = urllib.request.Request(
    "%s/admin/backends/%s/%s" % (os.environ["FAIRGATE_URL"], backend, action),
    data=json.dumps(body).encode() if body else b"", method="POST",
    headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
for attempt in range(3 if key else 0):
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            print("fairgate %s %s: %s" % (action, backend, answer.read()[:200]))
        break
    except Exception as exc:  # reported, never fatal: the pod must stop or start anyway
        print("fairgate %s %s failed: %s" % (action, backend, exc), file=sys.stderr)
        time.sleep(1)
else:
    sys.exit(0)
if action == "drain":
    time.sleep(grace + float(os.environ.get("FAIRGATE_DRAIN_MARGIN_S", "0")))
