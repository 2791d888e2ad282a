"""DMI v1beta1: generated stubs, conversion, EdgeCore client and the mapper server."""
