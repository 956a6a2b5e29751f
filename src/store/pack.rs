//! The MessagePack a script call carries: a decision's and a release's spec (scalars the script
//! reads by position) and what a lease keeps (a map), written straight into one buffer.

/// MessagePack scalars, as the script's `cmsgpack.unpack` reads them back one by one.
#[derive(Default)]
pub(super) struct Pack(pub(super) Vec<u8>);

impl Pack {
    /// A buffer for a decision's spec or its lease's data (a few hundred bytes each), sized so that
    /// packing rarely grows it: grown from empty, each buffer took a reallocation and a copy at
    /// every doubling (`scripts/count.sh` in Redis mode counts the instructions this saves).
    pub(super) fn sized() -> Self {
        Pack(Vec::with_capacity(512))
    }

    pub(super) fn nil(&mut self) {
        self.0.push(0xc0);
    }

    pub(super) fn bool(&mut self, b: bool) {
        self.0.push(if b { 0xc3 } else { 0xc2 });
    }

    /// A number: a small whole one in one byte, any other as a double (exact, as the script
    /// computes with doubles). Whether it is whole is asked of the cast back, not of `f64::fract`,
    /// which is a call into libm on x86-64's baseline (450 instructions per admission).
    pub(super) fn num(&mut self, x: f64) {
        if (0.0..128.0).contains(&x) && f64::from(x as u8) == x {
            self.0.push(x as u8);
        } else {
            self.0.push(0xcb);
            self.0.extend_from_slice(&x.to_be_bytes());
        }
    }

    pub(super) fn str(&mut self, s: &str) {
        self.str_head(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }

    /// The header of a string of `n` bytes.
    fn str_head(&mut self, n: usize) {
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else if n < 0x100 {
            self.0.extend_from_slice(&[0xd9, n as u8]);
        } else if n < 0x1_0000 {
            self.0.push(0xda);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdb);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    /// A string made of `parts`, written without joining them first.
    pub(super) fn str_parts(&mut self, parts: &[&str]) {
        let n: usize = parts.iter().map(|s| s.len()).sum();
        self.str_head(n);
        for s in parts {
            self.0.extend_from_slice(s.as_bytes());
        }
    }

    pub(super) fn strs(&mut self, v: &[&str]) {
        self.array(v.len());
        for s in v {
            self.str(s);
        }
    }

    pub(super) fn array(&mut self, n: usize) {
        self.container(0x90, 0xdd, n);
    }

    pub(super) fn map(&mut self, n: usize) {
        self.container(0x80, 0xdf, n);
    }

    /// The header of an array or map of `n` items: `fix | n` in one byte below 16, else `wide`
    /// and a 32-bit count.
    fn container(&mut self, fix: u8, wide: u8, n: usize) {
        if n < 16 {
            self.0.push(fix | n as u8);
        } else {
            self.0.push(wide);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    pub(super) fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pack;

    #[test]
    fn a_small_whole_number_is_one_byte_any_other_a_double() {
        for (x, one) in [
            (0.0, true),
            (5.0, true),
            (127.0, true),
            (128.0, false),
            (0.5, false),
        ] {
            let mut p = Pack::default();
            p.num(x);
            if one {
                assert_eq!(p.0, [x as u8], "{x}");
            } else {
                let mut want = vec![0xcb];
                want.extend_from_slice(&x.to_be_bytes());
                assert_eq!(p.0, want, "{x}");
            }
        }
        for x in [-1.0, 127.5, f64::NAN, f64::INFINITY, 1e300] {
            let mut p = Pack::default();
            p.num(x);
            assert_eq!((p.0[0], p.0.len()), (0xcb, 9), "{x}");
        }
    }

    #[test]
    fn arrays_and_maps_of_16_or_more_items_take_a_32_bit_count() {
        let mut p = Pack::default();
        p.array(3);
        p.map(15);
        p.array(16);
        p.map(70_000);
        assert_eq!(p.0, [0x93, 0x8f, 0xdd, 0, 0, 0, 16, 0xdf, 0, 1, 0x11, 0x70]);
    }
}
