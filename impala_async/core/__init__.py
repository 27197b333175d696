"""The pure core: trajectory spec, wire format and its bounded MessagePack reader, ring buffer, frame stacks,
networks and V-trace. Imports neither zmq nor asyncio; imports nothing else of the package."""
