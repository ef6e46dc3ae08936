"""Stream processors on faust-streaming: moderation on the ingress and token paths,
transcript writes and billing rows, each a small agent over a topic. The stores they write
to live in ``tokenbus.stores``."""
