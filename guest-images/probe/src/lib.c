/* lib.c - the few libc pieces a freestanding build still needs. */
#include "probe.h"

/*
 * String instructions: one instruction per call, which matters when the
 * host runs the guest in its instruction emulator (e.g. kvm_pvm before the
 * guest is PVM-aware), where every instruction costs about a microsecond.
 */
void *memset(void *d, int c, size_t n)
{
	void *p = d;
	__asm__ volatile("rep stosb" : "+D"(p), "+c"(n) : "a"(c) : "memory");
	return d;
}

void *memcpy(void *d, const void *s, size_t n)
{
	void *p = d;
	__asm__ volatile("rep movsb" : "+D"(p), "+S"(s), "+c"(n) : : "memory");
	return d;
}

void *memmove(void *d, const void *s, size_t n)
{
	u8 *dp = d;
	const u8 *sp = s;
	if (dp <= sp || dp >= sp + n)
		return memcpy(d, s, n);
	while (n--)
		dp[n] = sp[n];
	return d;
}

int memcmp(const void *a, const void *b, size_t n)
{
	const u8 *x = a, *y = b;
	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i])
			return x[i] < y[i] ? -1 : 1;
	return 0;
}

size_t strlen(const char *s)
{
	size_t n = 0;
	while (s[n])
		n++;
	return n;
}

int strcmp(const char *a, const char *b)
{
	while (*a && *a == *b) {
		a++;
		b++;
	}
	return (u8)*a - (u8)*b;
}

bool str_eq_n(const char *a, size_t alen, const char *b)
{
	size_t bl = strlen(b);
	return bl == alen && memcmp(a, b, alen) == 0;
}

bool parse_u64(const char *s, size_t n, u64 *out)
{
	u64 v = 0;
	if (n == 0)
		return false;
	for (size_t i = 0; i < n; i++) {
		if (s[i] < '0' || s[i] > '9')
			return false;
		u64 d = (u64)(s[i] - '0');
		if (v > (~0UL - d) / 10)
			return false;
		v = v * 10 + d;
	}
	*out = v;
	return true;
}

bool parse_size(const char *s, size_t n, u64 *out)
{
	u32 shift = 0;
	if (n && (s[n - 1] == 'K' || s[n - 1] == 'k'))
		shift = 10;
	else if (n && (s[n - 1] == 'M' || s[n - 1] == 'm'))
		shift = 20;
	else if (n && (s[n - 1] == 'G' || s[n - 1] == 'g'))
		shift = 30;
	if (shift)
		n--;
	u64 v = 0;
	if (n > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
		for (size_t i = 2; i < n; i++) {
			char c = s[i];
			u64 d;
			if (c >= '0' && c <= '9')
				d = (u64)(c - '0');
			else if (c >= 'a' && c <= 'f')
				d = (u64)(c - 'a' + 10);
			else if (c >= 'A' && c <= 'F')
				d = (u64)(c - 'A' + 10);
			else
				return false;
			if (v >> 60)
				return false;
			v = v << 4 | d;
		}
	} else if (!parse_u64(s, n, &v)) {
		return false;
	}
	if (shift && (v >> (64 - shift)))
		return false;
	*out = v << shift;
	return true;
}
