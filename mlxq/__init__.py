"""The mlxq command line and the process supervisor behind `mlxq up`."""
