"""Generated gRPC stubs for jaxmoe.proto (see generate.sh)."""
