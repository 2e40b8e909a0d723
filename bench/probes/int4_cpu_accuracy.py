"""How far torch's int4 CPU product is from exact, with f32 and with bf16 activations: a
Q4_0-shaped 4096 x 4096 weight (f16 scales, q - 8), against float64.

    python bench/probes/int4_cpu_accuracy.py
"""

import torch


def main() -> None:
    torch.manual_seed(0)
    n, k = 4096, 4096
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    s = (torch.rand(n, k // 32) * 0.02 + 0.001).half().float()  # Q4_0's f16 scales
    w = (q.float() - 8) * s.repeat_interleave(32, dim=1)  # what gguf's dequantize gives
    x = torch.randn(1, k) * 0.5
    ref = x.double() @ w.double().T
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    for dtype in (torch.float32, torch.bfloat16):
        # torch's int4 weight: (q - 8) * scale + zero, scales and zeros (K/32, N, 2)
        scales_zeros = torch.stack([s.T, torch.zeros_like(s.T)], dim=-1).to(dtype)
        y = torch._weight_int4pack_mm_for_cpu(x.to(dtype), packed, 32, scales_zeros)
        err = (y.double() - ref).abs().max() / ref.abs().max()
        print(f"{dtype}: max abs error / max |y| {err.item():.2e}, output {y.dtype}")


if __name__ == "__main__":
    main()
