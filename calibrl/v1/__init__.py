"""Generated wire code of the calibrl.v1 contract (see proto/calibrl/v1). Do not edit:
regenerate with `python scripts/gen_proto.py`."""
