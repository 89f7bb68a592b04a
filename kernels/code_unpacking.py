"""The codecs' unpacking on the GPU, shared by the Triton scan kernels (`maxsim_codes`) and the Gluon
stream kernel (`maxsim_int8_hopper_stream`): inline PTX over four bytes of codes in a 32-bit register.

int4: a byte holds value 2m in its low nibble and 2m + 1 in its high one, each a two's-complement nibble; the
two outputs are the four low and the four high nibbles as int8: ((n ^ 8) + 0x78) ^ 0x80 per byte, 7
integer instructions for 8 values where per-element int32 arithmetic takes ~5 each (Hopper issues 64
integer instructions a clock per SM, half its fp32 rate). Constraints "=r,=r,r", pack=4.

int4, as stored (`INT4_BIASED_ASM`): the nibbles' values plus 8 (n + 8, 0..15), one LOP3 a register, 3
instructions for 8 values; a product of them is the signed one plus 8 times the sum of the other operand,
which the stream kernel's first product takes away (exact in int32). Constraints "=r,=r,r", pack=4.

int2: `quarter_values_asm` makes 2-bit code ``part`` (bits 2 part, 2 part + 1) of each of four bytes into its
value v (0..3) as int8: the shifted bytes masked, no carry between bytes, 1 instruction for part 0 and 2
for the others (7 for 16 values, where the odd values 2v - 3 took 16). The codes stand for the odd values;
a product of the v is half that of the odd values plus 1.5 times the other operand's sum, which the stream
kernel's fold takes back (2 acc - 3 sum, exact in int32). Constraints "=r,r", pack=4.

residual2: `bucket_planes_asm` makes a 2-bit bucket of each of four bytes into its bit planes (bit 0, bit 1,
both) as fp16 0 or one unit (`PLANE_UNIT_ASM`). Constraints "=r,=r,=r,=r,=r,=r,r", pack=4.
"""

INT4_NIBBLES_ASM = (
    "{ .reg .b32 t; "
    "lop3.b32 t, $2, 0x0f0f0f0f, 0x08080808, 0x6a; add.u32 t, t, 0x78787878; xor.b32 $0, t, 0x80808080; "
    "shr.u32 t, $2, 4; "
    "lop3.b32 t, t, 0x0f0f0f0f, 0x08080808, 0x6a; add.u32 t, t, 0x78787878; xor.b32 $1, t, 0x80808080; }"
)


INT4_BIASED_ASM = (
    "{ .reg .b32 t; "
    "lop3.b32 $0, $2, 0x0f0f0f0f, 0x08080808, 0x6a; "
    "shr.u32 t, $2, 4; lop3.b32 $1, t, 0x0f0f0f0f, 0x08080808, 0x6a; }"
)


def quarter_values_asm(part: int) -> str:
    """int2: the values v (0..3) of 2-bit code ``part`` of four bytes, int8 (module docstring)."""
    if part == 0:
        return "and.b32 $0, $1, 0x03030303;"
    return "{ .reg .b32 t; " + f"shr.u32 t, $1, {2 * part}; " + "and.b32 $0, t, 0x03030303; }"


def bucket_planes_asm(part: int) -> str:
    """residual2: bit 0, bit 1 and their AND of bucket ``part`` of four bytes as fp16 0 or 2^-14 (the bit
    moved to the exponent's lowest bit: 0x0400, the smallest normal fp16; the launcher scales the sums
    back by 2^14). prmt spreads bytes 0,1 (2,3) to the two halves of a register, so one shift and one AND
    make two values."""
    s0, s1 = 10 - 2 * part, 9 - 2 * part
    half = (
        "shl.b32 a, {t}, {s0}; shl.b32 c, {t}, {s1}; and.b32 {o0}, a, 0x04000400; "
        "and.b32 {o1}, c, 0x04000400; lop3.b32 {o2}, a, c, 0x04000400, 0x80; "
    )
    return (
        "{ .reg .b32 t0, t1, a, c; prmt.b32 t0, $6, 0, 0x4140; prmt.b32 t1, $6, 0, 0x4342; "
        + half.format(t="t0", s0=s0, s1=s1, o0="$0", o1="$2", o2="$4")
        + half.format(t="t1", s0=s0, s1=s1, o0="$1", o1="$3", o2="$5")
        + "}"
    )


PLANE_UNIT_ASM = 2.0**-14  # the value of a set bit in `bucket_planes_asm`'s planes
