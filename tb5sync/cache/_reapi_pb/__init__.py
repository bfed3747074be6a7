"""The Remote Execution API's Python stubs, generated from proto/ by scripts/gen_protos.py (`make protos`).

Importing them needs grpcio and protobuf (the `grpc` extra)."""
