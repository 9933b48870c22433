//! The GPT-2 byte-level alphabet, inverted: which byte a byte-level vocabulary character stands for.
//!
//! Byte-level BPE writes every byte as a visible character: bytes that are printable in Latin-1
//! (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves, and the remaining 68 bytes, in
//! increasing order, are written as U+0100, U+0101, … Invariant: the map is a bijection between
//! 256 bytes and 256 chars. Costs: a range check and, for the shifted chars, one array index.

/// Whether byte `b` is written as the char with the same code point.
const fn stands_for_itself(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The 68 bytes written as U+0100 + n, indexed by n.
const SHIFTED: [u8; 68] = {
    let mut out = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !stands_for_itself(b as u8) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

/// The byte that byte-level char `c` stands for, or `None` when `c` is not in the alphabet.
pub(crate) fn byte_level_char_to_byte(c: char) -> Option<u8> {
    let code = c as u32;
    if code < 256 && stands_for_itself(code as u8) {
        return Some(code as u8);
    }
    let n = code.checked_sub(256)? as usize;
    SHIFTED.get(n).copied()
}

/// Whether `c` belongs to the byte-level alphabet.
pub(crate) fn is_byte_level_char(c: char) -> bool {
    byte_level_char_to_byte(c).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    #[test]
    fn alphabet_matches_the_tokenizers_crate() {
        let alphabet = ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        let mut seen = [false; 256];
        for c in alphabet {
            let b = byte_level_char_to_byte(c).expect("char of the byte-level alphabet");
            assert!(!seen[b as usize], "byte {b} mapped twice");
            seen[b as usize] = true;
        }
    }

    #[test]
    fn space_and_newline_are_shifted() {
        assert_eq!(byte_level_char_to_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_char_to_byte('a'), Some(b'a'));
        assert_eq!(byte_level_char_to_byte('中'), None);
        assert_eq!(byte_level_char_to_byte(' '), None);
    }
}
