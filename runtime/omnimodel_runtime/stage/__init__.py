"""Stage side of the runtime: the stage server and the handles the gateway uses to reach stages."""
