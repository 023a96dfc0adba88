"""What a device holds and how fast it could run a build: the GPU catalog, the roofline arithmetic, sizing."""
