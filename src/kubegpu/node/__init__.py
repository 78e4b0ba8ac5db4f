"""The node daemon (``kubegpu node``): GPU discovery, health, the kubelet device plugins and the
node's published state. Edges (gRPC, filesystem watch, signals) live in their own modules."""
